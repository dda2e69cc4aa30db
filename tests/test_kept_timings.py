"""The test session leaves the machine's kept timing tables as it found them (`tests/kept_timings.py`)."""

import json

from tests.kept_timings import kept_tables, restore


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_tables_written_changed_or_removed_during_a_session_are_put_back(tmp_path):
    step = tmp_path / "artifacts" / "key1" / "step_costs.json"
    batch = tmp_path / "artifacts" / "key3" / "step_costs.json"
    eager = tmp_path / "costs" / "abc-float32-AVX2-2t-eager.json"
    other = tmp_path / "artifacts" / "key1" / "key.json"  # not a timing table: left alone
    _write(step, {"1 row": {"1": 22.4, "8": 35.8}})
    _write(batch, {"4 rows": {"1": 29.0}})
    _write(other, {"cpu": "AVX2"})
    before = kept_tables(tmp_path)
    assert set(before) == {step, batch}

    _write(step, {"1 row": {"9": 37.9}})  # a test's timing under load replaced the table
    batch.unlink()  # a condemned table was dropped
    _write(eager, {"lengths": [1], "eager_ms": [90.0]})  # a table kept for the first time
    _write(tmp_path / "artifacts" / "key2" / "step_costs.json", {"1 row": {"1": 50.0}})  # an artifact built during the session
    _write(other, {"cpu": "AVX512"})

    changed = restore(tmp_path, before)
    assert kept_tables(tmp_path) == before
    assert json.loads(step.read_text()) == {"1 row": {"1": 22.4, "8": 35.8}}
    assert json.loads(batch.read_text()) == {"4 rows": {"1": 29.0}}
    assert not eager.exists()
    assert json.loads(other.read_text()) == {"cpu": "AVX512"}
    assert len(changed) == 4
    assert restore(tmp_path, before) == []  # nothing left to put back


def test_kept_costs_keep_entries_apart_and_drop_the_one_its_steps_contradict(tmp_path):
    """`KeptCosts`: one file beside an artifact, one table per entry; a table this process's steps contradict is
    dropped, from the file too, and the other entries stay; an artifact without a file keeps nothing."""
    from hf_bpd.runtime.cache_files import COSTS_FILE, STALE_STEPS, KeptCosts

    class Artifact:
        path = tmp_path / "step.pt2"

    KeptCosts(Artifact(), "1 row").keep({1: 10.0, 4: 13.0})
    KeptCosts(Artifact(), "4 rows").keep({1: 7.0})
    again = KeptCosts(Artifact(), "1 row")
    assert again.table == {1: 10.0, 4: 13.0} and 4 in again
    dropped = [again.contradicted(4, 100.0) for _ in range(STALE_STEPS)]
    assert dropped[-1] and not any(dropped[:-1]) and again.table == {} and 4 not in again
    assert json.loads((tmp_path / COSTS_FILE).read_text()) == {"4 rows": {"1": 7.0}}
    confirmed = KeptCosts(Artifact(), "4 rows")
    assert not any(confirmed.contradicted(1, 7.2) for _ in range(STALE_STEPS)) and confirmed.table == {1: 7.0}
    KeptCosts(None, "1 row").keep({1: 1.0})  # nowhere to keep it: no error
