// Exact p-best paths through a top-k lattice under head log-probabilities plus a weighted KenLM n-gram score:
// the compiled fast path of hf_bpd.rescorers.ngram (`pbest_python` there is the reference: same search, same arithmetic,
// same tie-breaking, so both return identical drafts). Loaded with ctypes; C ABI at the bottom.
//
// Dynamic programming over heads. Paths that reach the same KenLM state have identical futures (KenLM states are
// minimal), so per state only the p best partial paths can matter: keeping them is exact. Paths are ordered by
// score (higher first), then by rank vector (lexicographically smaller first), a total order.
//
// Speed: a head's lattice row is scored after hundreds of states that share their most recent words. KenLM scores
// a word by walking its context right to left (word, then 1, 2, ... context words) until an n-gram is missing, then
// adds the state's backoffs. The walk over the first m context words depends on those words only, so it is
// memoised per distinct m-word context suffix; only walks that keep matching go deeper. The result is bit-identical
// to KenLM's FullScore (same lookups, same float additions in the same order).

#include "lm/enumerate_vocab.hh"
#include "lm/model.hh"
#include "util/exception.hh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <vector>

namespace {

using lm::WordIndex;
using lm::ngram::State;

// Token id (a decimal vocabulary word, as build_ngram writes them) -> KenLM word index; 0 (<unk>) otherwise.
class TokenIds : public lm::EnumerateVocab {
 public:
  void Add(WordIndex index, const StringPiece &word) override {
    if (word.size() == 0 || word.size() > 18 || (word.size() > 1 && word[0] == '0')) return;
    int64_t id = 0;
    for (char c : word) {
      if (c < '0' || c > '9') return;
      id = id * 10 + (c - '0');
    }
    if (static_cast<size_t>(id) >= table.size()) table.resize(id + 1, 0);
    table[id] = index;
  }
  WordIndex operator()(int64_t id) const {
    return id >= 0 && static_cast<size_t>(id) < table.size() ? table[id] : 0;
  }
  std::vector<WordIndex> table;
};

struct Handle {
  std::unique_ptr<lm::base::Model> model;
  TokenIds ids;
  int order;
};

// Ids for distinct word sequences (the first `length` words of a State): open addressing, reused across calls.
class StateIds {
 public:
  void Clear(size_t expected) {
    size_t want = 16;
    while (want < 2 * expected) want *= 2;
    if (slots_.size() < want) slots_.resize(want);
    std::fill(slots_.begin(), slots_.begin() + want, -1);
    mask_ = want - 1;
    keys_.clear();
  }
  // The id of `words[0, length)` (ids count up from 0 in insertion order); `added` tells whether it is new.
  int32_t Find(const State &state, unsigned char length, bool &added) {
    size_t i = util::MurmurHashNative(state.words, sizeof(WordIndex) * length, length) & mask_;
    for (;; i = (i + 1) & mask_) {
      const int32_t id = slots_[i];
      if (id < 0) break;
      const State &key = keys_[id];
      if (key.length == length && !std::memcmp(key.words, state.words, sizeof(WordIndex) * length)) {
        added = false;
        return id;
      }
    }
    added = true;
    slots_[i] = static_cast<int32_t>(keys_.size());
    keys_.push_back(state);
    keys_.back().length = length;
    if (2 * keys_.size() > mask_) Grow();
    return static_cast<int32_t>(keys_.size() - 1);
  }
  const State &Key(int32_t id) const { return keys_[id]; }
  size_t Size() const { return keys_.size(); }

 private:
  void Grow() {
    std::vector<State> keys;
    keys.swap(keys_);
    Clear(keys.size() * 2);
    bool added;
    for (const State &key : keys) Find(key, key.length, added);
  }
  std::vector<int32_t> slots_;
  std::vector<State> keys_;
  size_t mask_ = 0;
};

// KenLM's walk for one word after the first m words of a context (see GenericModel::ScoreExceptBackoff).
struct Walk {
  float prob;            // probability of the longest n-gram matched, before backoffs
  unsigned char length;  // its length, the word included
  bool more;             // the walk used every context word and may go on with a longer context
  bool known;
  int32_t slot;          // bucket of `out` among the next head's states, -1 until inserted
  uint64_t extend_left;  // KenLM's pointer to the matched n-gram (when `more`)
  State out;             // KenLM's state after the word
};

// One partial path: its score, its last rank and its prefix (an index into the previous head's paths).
struct Path {
  double score;
  int32_t parent;
  int32_t rank;
};

template <class Model>
class Search {
 public:
  Search(const Model &model, const TokenIds &ids, const int64_t *tokens, const double *logprobs,
         const double *weights, int heads, int k, int p, int order)
      : model_(model), ids_(ids), tokens_(tokens), logprobs_(logprobs), weights_(weights), heads_(heads), k_(k),
        p_(p), keep_(order - 1), layers_(heads + 1) {}

  // A score the p-th best complete path is known to reach (the p-th best of some p complete paths): partial paths
  // that cannot reach it are dropped. Kept a hair below, so rounding in the bounds never drops a path that ties it.
  void SetFloor(double floor) { floor_ = floor - 1e-9 * (1.0 + std::abs(floor)); }

  // Fills out_ranks (n, heads) and out_scores (n) with the n <= p best complete paths, best first; returns n.
  int Run(const int64_t *context, int context_length, int32_t *out_ranks, double *out_scores) {
    State start, next;
    model_.NullContextWrite(&start);
    for (int i = 0; i < context_length; ++i) {
      model_.FullScore(start, ids_(context[i]), next);
      start = Truncate(next);
    }
    rest_.assign(heads_ + 1, 0.0);  // rest_[i]: the most heads i.. can add (their best log-probabilities)
    for (int i = heads_ - 1; i >= 0; --i) {
      double best = -std::numeric_limits<double>::infinity();
      for (int r = 0; r < k_; ++r) best = std::max(best, logprobs_[i * k_ + r]);
      rest_[i] = rest_[i + 1] + best;
    }
    layers_[0].push_back(Path{0.0, -1, -1});
    std::vector<State> states{start};
    std::vector<int32_t> begin{0, 1};  // paths of state s: layers_[i][begin[s], begin[s + 1])
    for (int i = 0; i < heads_; ++i) {
      Step(i, states, begin);
    }
    const std::vector<Path> &final_paths = layers_[heads_];
    const int n = static_cast<int>(final_paths.size());
    for (int j = 0; j < n; ++j) {
      out_scores[j] = final_paths[j].score;
      int32_t at = j;
      for (int i = heads_; i > 0; --i) {
        out_ranks[j * heads_ + i - 1] = layers_[i][at].rank;
        at = layers_[i][at].parent;
      }
    }
    return n;
  }

 private:
  // Extends every state's paths by head i's k tokens; `states` and `begin` become the next head's.
  void Step(int i, std::vector<State> &states, std::vector<int32_t> &begin) {
    const bool last = i + 1 == heads_;
    const size_t n_states = states.size();
    // Context suffixes: group[m][s] numbers the distinct first-m-words of the states with length >= m.
    unsigned char longest = 0;
    for (const State &s : states) longest = std::max(longest, s.length);
    group_.resize(longest + 1);
    walks_.resize(longest + 1);
    for (unsigned char m = 1; m <= longest; ++m) {
      group_[m].assign(n_states, -1);
      suffixes_.Clear(n_states);
      bool added;
      for (size_t s = 0; s < n_states; ++s) {
        if (states[s].length >= m) group_[m][s] = suffixes_.Find(states[s], m, added);
      }
      walks_[m].assign(suffixes_.Size() * k_, Walk{0.f, 0, false, false, -1, 0, State()});
    }
    walks_[0].assign(k_, Walk{0.f, 0, false, false, -1, 0, State()});
    State null_state;
    model_.NullContextWrite(&null_state);
    for (int r = 0; r < k_; ++r) {
      const WordIndex word = ids_(tokens_[i * k_ + r]);
      Walk &w = walks_[0][r];
      const lm::FullScoreReturn ret = model_.FullScore(null_state, word, w.out);
      w = Walk{ret.prob, 1, !ret.independent_left && 1 < model_.Order(), true, -1, ret.extend_left, w.out};
    }

    next_states_.Clear(n_states * 2);
    filled_.clear();
    // The n-gram term of token r after state s (KenLM's FullScore, from the memoised walks).
    auto term_of = [&](size_t s, int r) -> std::pair<double, Walk *> {
      const State &state = states[s];
      Walk *w = &walks_[0][r];
      for (unsigned char m = 1; m <= state.length && w->more; ++m) {
        Walk &deeper = walks_[m][static_cast<size_t>(group_[m][s]) * k_ + r];
        if (!deeper.known) Extend(state, m, ids_(tokens_[i * k_ + r]), *w, deeper);
        w = &deeper;
      }
      float prob = w->prob;  // FullScore: the match, then the backoffs of the unmatched context, in order
      for (unsigned char b = w->length - 1; b < state.length; ++b) prob += state.backoff[b];
      return {logprobs_[i * k_ + r] + weights_[i] * static_cast<double>(prob), w};
    };
    if (last) {
      // Every path ends in one bucket of the p best. A path's last term is at most its head log-probability (the
      // n-gram's log-probability is <= 0 and its weight >= 0), so once the bucket is full, a state whose best path
      // plus the row's best log-probability is below the bucket's worst cannot place a path: states are taken best
      // first and the rest skipped (exact: the bucket ends with the same p paths).
      order_.resize(n_states);
      for (size_t s = 0; s < n_states; ++s) order_[s] = static_cast<int32_t>(s);
      const std::vector<Path> &paths = layers_[i];
      std::stable_sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
        return paths[begin[a]].score > paths[begin[b]].score;
      });
      for (const int32_t s : order_) {
        const double best = paths[begin[s]].score;
        if (best + rest_[i] < Cutoff()) break;  // rest_[i]: the last row's best log-probability
        for (int r = 0; r < k_; ++r) {
          if (best + logprobs_[i * k_ + r] < Cutoff()) continue;
          Offer(i, 0, begin[s], begin[s + 1], term_of(s, r).first, r);
        }
      }
    } else {
      // A path can add at most rest_[i + 1] after this head: one that cannot reach floor_ is dropped.
      const std::vector<Path> &paths = layers_[i];
      for (int r = 0; r < k_; ++r) {
        const double reach = logprobs_[i * k_ + r] + rest_[i + 1];
        for (size_t s = 0; s < n_states; ++s) {
          if (paths[begin[s]].score + reach < floor_) continue;
          auto [term, w] = term_of(s, r);
          if (w->slot < 0) {
            bool added;
            const State out = Truncate(w->out);
            w->slot = next_states_.Find(out, out.length, added);
          }
          Offer(i, w->slot, begin[s], begin[s + 1], term, r, floor_ - term - rest_[i + 1]);
        }
      }
    }
    // The next head's paths: each state's bucket sorted best first.
    std::vector<Path> &out = layers_[i + 1];
    begin.assign(1, 0);
    states.clear();
    for (size_t slot = 0; slot < filled_.size(); ++slot) {
      Path *heap = &bucket_[slot * p_];
      std::sort_heap(heap, heap + filled_[slot], Better(this, i + 1));
      out.insert(out.end(), heap, heap + filled_[slot]);
      begin.push_back(static_cast<int32_t>(out.size()));
      if (!last) states.push_back(next_states_.Key(static_cast<int32_t>(slot)));
    }
  }

  // The walk over m context words, from the walk over m - 1 that matched all of them.
  void Extend(const State &state, unsigned char m, WordIndex word, const Walk &shorter, Walk &w) {
    // One lookup tells whether the m-th context word matches (ExtendLeft resumes the shorter walk; its
    // probability is relative, so a match is scored again in full below).
    const float no_backoff[KENLM_MAX_ORDER] = {0.f};
    float backoff_out[KENLM_MAX_ORDER];
    unsigned char next_use;
    const lm::FullScoreReturn probe = model_.ExtendLeft(state.words + m - 1, state.words + m, no_backoff,
                                                        shorter.extend_left, m, backoff_out, next_use);
    if (probe.ngram_length != m + 1) {  // no match: longer contexts end the same way as the shorter one
      w = shorter;  // (its out state, hence its bucket, too)
      w.more = false;
      return;
    }
    State context = state;
    context.length = m;
    const lm::FullScoreReturn ret = model_.FullScore(context, word, w.out);  // matched: no backoff is added
    w = Walk{ret.prob, ret.ngram_length, !ret.independent_left && m + 1 < model_.Order(), true, -1,
             ret.extend_left, w.out};
  }

  bool Full(int32_t slot) const {
    return static_cast<size_t>(slot) < filled_.size() && filled_[slot] == p_;
  }

  // The score a last-head path must reach to place: the floor, or the full final bucket's worst.
  double Cutoff() const { return Full(0) ? std::max(floor_, bucket_[0].score) : floor_; }

  // Adds the paths of one state extended by one token (term) to a bucket that keeps the p best; prefixes scoring
  // below `least` are not offered (they cannot reach the floor).
  void Offer(int i, int32_t slot, int32_t first, int32_t end, double term, int r,
             double least = -std::numeric_limits<double>::infinity()) {
    if (static_cast<size_t>(slot) >= filled_.size()) {
      filled_.resize(slot + 1, 0);
      if (bucket_.size() < filled_.size() * p_) bucket_.resize(filled_.size() * p_ * 2);
    }
    Path *heap = &bucket_[static_cast<size_t>(slot) * p_];
    int32_t &n = filled_[slot];
    const Better better(this, i + 1);
    for (int32_t j = first; j < end; ++j) {  // best first: stop at the first that cannot enter
      if (layers_[i][j].score < least) break;
      const Path c{layers_[i][j].score + term, j, r};
      if (n < p_) {
        heap[n++] = c;
        std::push_heap(heap, heap + n, better);
      } else if (better(c, heap[0])) {
        std::pop_heap(heap, heap + n, better);
        heap[n - 1] = c;
        std::push_heap(heap, heap + n, better);
      } else {
        break;
      }
    }
  }

  // Strict "a before b" for two paths over heads [0, depth): score, then rank vector.
  struct Better {
    Better(const Search *s, int depth) : s(s), depth(depth) {}
    bool operator()(const Path &a, const Path &b) const {
      if (a.score != b.score) return a.score > b.score;
      return s->RanksLess(depth, a, b);
    }
    const Search *s;
    int depth;
  };

  bool RanksLess(int depth, const Path &a, const Path &b) const {
    if (a.parent != b.parent && depth > 1) {  // distinct prefixes differ somewhere before the last rank
      return RanksLess(depth - 1, layers_[depth - 1][a.parent], layers_[depth - 1][b.parent]);
    }
    return a.rank < b.rank;
  }

  // History beyond the requested order is dropped (a shorter suffix of a minimal state is minimal).
  State Truncate(State s) const {
    if (s.length > keep_) s.length = static_cast<unsigned char>(keep_);
    return s;
  }

  const Model &model_;
  const TokenIds &ids_;
  const int64_t *tokens_;
  const double *logprobs_, *weights_;
  int heads_, k_, p_, keep_;
  std::vector<std::vector<Path>> layers_;  // layers_[i]: the kept paths over heads [0, i)
  std::vector<std::vector<int32_t>> group_;
  std::vector<std::vector<Walk>> walks_;  // walks_[m][group * k + r]
  StateIds suffixes_, next_states_;
  std::vector<Path> bucket_;  // p slots per next state, each a heap with the worst path on top
  std::vector<int32_t> filled_;
  std::vector<int32_t> order_;  // the last head's states, best path first
  std::vector<double> rest_;
  double floor_ = -std::numeric_limits<double>::infinity();
};

constexpr int kProbeWidth = 4;

template <class Model>
bool RunAs(const Handle &h, const int64_t *context, int context_length, const int64_t *tokens,
           const double *logprobs, const double *weights, int heads, int k, int p, int order, int32_t *out_ranks,
           double *out_scores, int &n) {
  const Model *model = dynamic_cast<const Model *>(h.model.get());
  if (!model) return false;
  order = std::min(order, h.order);
  Search<Model> search(*model, h.ids, tokens, logprobs, weights, heads, k, p, order);
  if (k > kProbeWidth && heads > 1) {
    // The p best paths of the lattice cut to its first kProbeWidth ranks are paths of the whole lattice: the
    // p-th best of them is a floor for the p-th best overall (a search ~1/50 of the cost of the whole one).
    std::vector<int64_t> probe_tokens(heads * kProbeWidth);
    std::vector<double> probe_logprobs(heads * kProbeWidth), probe_scores(p);
    std::vector<int32_t> probe_ranks(static_cast<size_t>(p) * heads);
    for (int i = 0; i < heads; ++i) {
      for (int r = 0; r < kProbeWidth; ++r) {
        probe_tokens[i * kProbeWidth + r] = tokens[i * k + r];
        probe_logprobs[i * kProbeWidth + r] = logprobs[i * k + r];
      }
    }
    Search<Model> probe(*model, h.ids, probe_tokens.data(), probe_logprobs.data(), weights, heads, kProbeWidth, p,
                        order);
    if (probe.Run(context, context_length, probe_ranks.data(), probe_scores.data()) == p) {
      search.SetFloor(probe_scores[p - 1]);
    }
  }
  n = search.Run(context, context_length, out_ranks, out_scores);
  return true;
}

void CopyError(const char *message, char *error, int error_size) {
  if (error_size <= 0) return;
  std::snprintf(error, error_size, "%s", message);
  for (char *c = error; *c; ++c) {
    if (*c == '\n') *c = ' ';
  }
}

}  // namespace

#define BPD_EXPORT __attribute__((visibility("default")))

extern "C" {

// Loads an ARPA or binary KenLM model; on failure returns NULL and writes a one-line message into `error`.
BPD_EXPORT void *bpd_ngram_load(const char *path, char *error, int error_size) {
  try {
    auto handle = std::make_unique<Handle>();
    lm::ngram::Config config;
    config.messages = nullptr;
    config.enumerate_vocab = &handle->ids;
    handle->model.reset(lm::ngram::LoadVirtual(path, config));
    handle->order = handle->model->Order();
    return handle.release();
  } catch (const std::exception &e) {
    CopyError(e.what(), error, error_size);
  }
  return nullptr;
}

BPD_EXPORT void bpd_ngram_free(void *handle) { delete static_cast<Handle *>(handle); }

BPD_EXPORT int bpd_ngram_order(const void *handle) { return static_cast<const Handle *>(handle)->order; }

// The p best paths through a (heads, k) lattice, best first, scored
//   sum_i logprobs[i, r_i] + weights[i] * log10 P(tokens[i, r_i] | history),
// the history starting from `context` (at most order - 1 token ids). Writes up to p rows of `out_ranks` (p, heads)
// and `out_scores` (p); returns how many, or -1 (with `error`) on failure.
BPD_EXPORT int bpd_ngram_pbest(const void *handle, const int64_t *context, int context_length, const int64_t *tokens,
                               const double *logprobs, const double *weights, int heads, int k, int p, int order,
                               int32_t *out_ranks, double *out_scores, char *error, int error_size) {
  try {
    const Handle &h = *static_cast<const Handle *>(handle);
    int n = -1;
    using namespace lm::ngram;
    const bool ran =
        RunAs<ProbingModel>(h, context, context_length, tokens, logprobs, weights, heads, k, p, order, out_ranks,
                            out_scores, n) ||
        RunAs<TrieModel>(h, context, context_length, tokens, logprobs, weights, heads, k, p, order, out_ranks,
                         out_scores, n) ||
        RunAs<QuantTrieModel>(h, context, context_length, tokens, logprobs, weights, heads, k, p, order, out_ranks,
                              out_scores, n) ||
        RunAs<ArrayTrieModel>(h, context, context_length, tokens, logprobs, weights, heads, k, p, order, out_ranks,
                              out_scores, n) ||
        RunAs<QuantArrayTrieModel>(h, context, context_length, tokens, logprobs, weights, heads, k, p, order,
                                   out_ranks, out_scores, n) ||
        RunAs<RestProbingModel>(h, context, context_length, tokens, logprobs, weights, heads, k, p, order,
                                out_ranks, out_scores, n);
    if (!ran) CopyError("unsupported KenLM model type", error, error_size);
    return n;
  } catch (const std::exception &e) {
    CopyError(e.what(), error, error_size);
  }
  return -1;
}

}  // extern "C"
