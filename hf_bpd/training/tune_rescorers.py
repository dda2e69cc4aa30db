"""Pick and tune the rescorers a checkpoint bundles: α per rescorer on held-out prompts, best n-gram by block efficiency.

    python training/tune_rescorers.py --checkpoint checkpoints/my-heads --questions benchmarks/tune_prompts.jsonl \\
        --ngram data/wiki_4gram.bin data/answers_4gram.bin --neural /tmp/neural_rescorer --neural-layers 2 --bundle

Block efficiency for every α of the paper's grid comes from one greedy reference decode per prompt
(`hf_bpd.tune_alpha`); the n-gram candidate with the best tuned block efficiency is bundled (with `--bundle`),
the neural rescorer too, each with its α, and the better of the two becomes the checkpoint's default rescorer;
entropy-adaptive α is reported for the chosen n-gram. Results go to
`<checkpoint>/tuning.json`.
"""

import argparse
import json
from pathlib import Path

import torch

import hf_bpd
from ..evaluation.bench import encode_messages, load_questions


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--questions", required=True)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--ngram", nargs="*", default=[], help="candidate KenLM binaries")
    p.add_argument("--neural", default=None, help="neural rescorer adapter dir (base_prefix type)")
    p.add_argument("--neural-layers", type=int, default=2)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bundle", action="store_true", help="bundle the chosen rescorers into the checkpoint")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    model = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(args.checkpoint)
    tokenizer = hf_bpd.load_tokenizer(args.checkpoint)
    questions = load_questions(args.questions)[: args.limit]
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}], None, model.device)["input_ids"]
               for q in questions]
    report = {"prompts": len(prompts), "prompt_file": args.questions, "max_new_tokens": args.max_new_tokens,
              "top_k": args.top_k}
    references = None

    def tune(name, rescorer):
        """One row of the model card's tuning table: BE for every α of the grid, keyed by the rescorer's name."""
        nonlocal references
        result = hf_bpd.tune_alpha(model, rescorer, prompts, args.max_new_tokens, top_k=args.top_k,
                                   references=references)
        references = result["references"]
        row = {"vanilla": round(result["vanilla"], 3), "alpha": result["alpha"],
               "best": round(result["block_efficiency"][result["alpha"]], 3),
               "block_efficiency": {str(a): round(b, 3) for a, b in result["block_efficiency"].items()}}
        print(f"{name}: vanilla {row['vanilla']:.3f}, best α {row['alpha']:g} -> {row['best']:.3f}  "
              f"{row['block_efficiency']}", flush=True)
        report[name] = row
        return row

    ngrams = {path: hf_bpd.NgramRescorer(path) for path in args.ngram}  # each at its own order
    ngram_rows = {path: tune(Path(path).name, rescorer) for path, rescorer in ngrams.items()}
    chosen = max(ngram_rows, key=lambda k: ngram_rows[k]["best"]) if ngram_rows else None
    if chosen:
        report["chosen"] = Path(chosen).name
        tune(f"{Path(chosen).name} entropy-adaptive", hf_bpd.NgramRescorer(chosen, entropy_adaptive=True))
    neural_row = None
    if args.neural:
        neural_row = tune(f"neural ({args.neural_layers} base layers + LoRA)",
                          hf_bpd.NeuralRescorer.from_bundle(model.base_lm, Path(args.neural), type="base_prefix",
                                                            num_layers=args.neural_layers))

    if args.bundle:
        if chosen:
            model.bundle_rescorer("ngram", chosen, alpha=ngram_rows[chosen]["alpha"],
                                  order=ngrams[chosen].model_order)
        if neural_row:
            model.bundle_rescorer("neural", args.neural, alpha=neural_row["alpha"], type="base_prefix",
                                  num_layers=args.neural_layers)
        bundled = {name: row for name, row in (("ngram", ngram_rows.get(chosen)), ("neural", neural_row)) if row}
        if bundled:  # the default `generate()` uses the rescorer with the best tuned block efficiency, if it helps
            best = max(bundled, key=lambda name: bundled[name]["best"])
            model.generation_config.rescorer = best if bundled[best]["best"] > bundled[best]["vanilla"] else None
            report["default_rescorer"] = model.generation_config.rescorer
            print(f"default rescorer: {model.generation_config.rescorer}")
        (Path(args.checkpoint) / "tuning.json").write_text(json.dumps(report, indent=2))
        model.save_pretrained(args.checkpoint)
        print(f"bundled into {args.checkpoint}")
    return 0


if __name__ == "__main__":
    main()
