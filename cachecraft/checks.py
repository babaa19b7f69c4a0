"""Per-model correctness check: does blending reproduce a full prefill on this model?

On a few generated prompts (system prefix, several chunks, question) it compares
against the model's own forward pass:

- ``full``: the engine's full prefill;
- ``recompute_all``: chunk-caches made under the system prefix alone, every token
  recomputed (fraction 1.0);
- ``cacheblend_all``: the deviation check with ratio 1.0;
- ``exact_prefix``: chunk-caches made under exactly this prompt's preceding chunks,
  nothing recomputed;
- ``generate``: greedy tokens continued from the blended cache equal plain ``generate``'s
  (in 16 bits, up to a near tie: two logits closer than twice the tolerance).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from cachecraft.engine import Segment, blended_prefill, generate_from
from cachecraft.model.loader import LoadedModel
from cachecraft.selection import DeviationCheck, create_chunk_cache

DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.05}


@dataclass
class CheckResult:
    name: str
    max_abs_diff: float
    passed: bool


@dataclass
class ModelCheckReport:
    model: str
    fingerprint: str
    dtype: str
    tolerance: float
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def _random_prompt(vocab_size: int, special: set[int], generator: torch.Generator,
                   sizes: list[int]) -> list[list[int]]:
    pool = torch.tensor([i for i in range(vocab_size) if i not in special])
    return [pool[torch.randint(0, len(pool), (n,), generator=generator)].tolist() for n in sizes]


@torch.inference_mode()
def check_model(lm: LoadedModel, prompts: int = 3, seed: int = 0, tolerance: float | None = None,
                chunk_tokens: int = 48, num_chunks: int = 3, new_tokens: int = 12) -> ModelCheckReport:
    """Run every check on ``prompts`` generated prompts; the report says what held."""
    tolerance = DEFAULT_TOLERANCE.get(lm.dtype, 1e-4) if tolerance is None else tolerance
    report = ModelCheckReport(lm.name, lm.fingerprint, str(lm.dtype).replace("torch.", ""), tolerance)
    generator = torch.Generator().manual_seed(seed)
    vocab = lm.model.config.vocab_size
    special = set(getattr(lm.tokenizer, "all_special_ids", []) or [])
    worst: dict[str, float] = {}
    generate_ok = True
    adapter, fp = lm.adapter, lm.fingerprint
    for _ in range(prompts):
        sizes = [12] + [chunk_tokens] * num_chunks + [10]
        parts = _random_prompt(vocab, special, generator, sizes)
        prefix, chunks, question = parts[0], parts[1:-1], parts[-1]
        ids = torch.tensor([t for p in parts for t in p], device=lm.device)
        reference = lm.model(ids[None]).logits[0, -1].float()

        def diff(result) -> float:
            return float((result.logits.float() - reference).abs().max())

        full = blended_prefill(adapter, [Segment(prefix, "prefix")] + [Segment(c) for c in chunks]
                               + [Segment(question, "question")], fingerprint=fp)
        worst["full"] = max(worst.get("full", 0.0), diff(full))

        prefix_kv = create_chunk_cache(adapter, [], prefix, fingerprint=fp, collect_stats=False)
        alone = [create_chunk_cache(adapter, [Segment(prefix, "prefix", cached=prefix_kv)], c,
                                    fingerprint=fp, collect_stats=False) for c in chunks]
        cached = [Segment(prefix, "prefix", cached=prefix_kv)]
        all_tokens = [Segment(c, cached=kv, recompute=range(len(c))) for c, kv in zip(chunks, alone)]
        recompute_all = blended_prefill(adapter, cached + all_tokens + [Segment(question, "question")],
                                        fingerprint=fp)
        worst["recompute_all"] = max(worst.get("recompute_all", 0.0), diff(recompute_all))

        blend_all = blended_prefill(adapter, cached + [Segment(c, cached=kv) for c, kv in zip(chunks, alone)]
                                    + [Segment(question, "question")],
                                    hooks=[DeviationCheck(1, 1.0)], fingerprint=fp)
        worst["cacheblend_all"] = max(worst.get("cacheblend_all", 0.0), diff(blend_all))

        in_context = blended_prefill(adapter, [Segment(prefix, "prefix")]
                                     + [Segment(c, save=True) for c in chunks] + [Segment(question, "question")],
                                     fingerprint=fp).saved
        exact = blended_prefill(adapter, cached + [Segment(c, cached=in_context[i + 1])
                                                   for i, c in enumerate(chunks)]
                                + [Segment(question, "question")], fingerprint=fp)
        worst["exact_prefix"] = max(worst.get("exact_prefix", 0.0), diff(exact))

        plain = lm.model.generate(ids[None], attention_mask=torch.ones_like(ids[None]),
                                  max_new_tokens=new_tokens, do_sample=False, temperature=None,
                                  top_p=None, top_k=None, output_scores=True, return_dict_in_generate=True,
                                  pad_token_id=lm.tokenizer.pad_token_id or lm.tokenizer.eos_token_id)
        blended = generate_from(lm.model, lm.tokenizer, recompute_all, max_new_tokens=new_tokens)
        generate_ok &= greedy_agrees(plain.sequences[0, ids.numel():].tolist(), top_two_margins(plain.scores),
                                     blended.tolist(), near_tie=2 * tolerance)

    for name, value in worst.items():
        report.results.append(CheckResult(name, value, value <= tolerance))
    report.results.append(CheckResult("generate", 0.0 if generate_ok else float("inf"), generate_ok))
    return report


def top_two_margins(scores) -> list[float]:
    """Per generated step, how far the chosen token's logit stood above the runner-up's."""
    return [float(step[0].float().topk(2).values.diff().abs()) for step in scores]


def greedy_agrees(plain: list[int], margins: list[float], blended: list[int], near_tie: float) -> bool:
    """Greedy tokens from the blended cache agree with plain ``generate``'s: equal token for
    token, or first different where plain's own top two logits were within ``near_tie``
    (``margins`` per step). Logits that may each be off by the check's tolerance can swap
    two tokens closer than twice that, so in 16 bits a near tie may go either way."""
    for step in range(max(len(plain), len(blended))):
        if step >= len(plain) or step >= len(blended) or plain[step] != blended[step]:
            return step < len(margins) and margins[step] < near_tie
    return True
