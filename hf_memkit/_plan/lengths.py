"""Planning from the rows' lengths (``plan_training(trainer="sft", lengths=[...])``, or
``mean_len=`` / ``max_len=``): padded or padding-free micro-batches, in tokens.

  * **padded** (the collator pads each micro-batch to its longest row): memory peaks at a
    micro-batch that holds a row of ``max_len``; compute goes to the padded tokens, on average
    ``E[max of micro_batch rows]`` per sample (rows drawn uniformly: sum over the distinct lengths
    of ``v x (F(v)^b - F(v-)^b)``; ``max_len`` when only the mean is known);
  * **padding-free** (``SFTConfig(padding_free=True)``: the micro-batch flattened into one row with
    ``position_ids``): memory peaks at the most tokens a micro-batch can hold (the ``micro_batch``
    longest rows, ``_trainers.packing``; ``micro_batch x max_len`` from the mean and max alone);
    compute goes to the real tokens, ``mean_len`` per sample. TRL takes the rows as they are
    (it raises for padding-free without packing unless ``max_length=None``), so the plan emits
    ``max_length=None`` and says to truncate rows beforehand. The attention must see the sequence
    boundaries from ``position_ids``: transformers' FlashAttention-2 and the mask-building
    kernels (sdpa, eager) of models on the attention interface (``_supports_attention_backend``)
    do (``masking_utils.find_packed_sequence_indices``); other models are never planned so.

Packing (bins of several rows) is not searched: its ``per_device_train_batch_size`` counts bins,
not samples, so it cannot keep ``target_batch_size`` exact; pinned (``packing=True``) it is
estimated as usual.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from .._errors import HfMemkitError
from .._trainers import TRAINERS
from .._trainers.packing import MAX_TOKENS, SEQ_LEN_FROM_ROWS, token_counts
from .request import Problem


@dataclass(frozen=True)
class Lengths:
    """The rows' token counts (``rows``), or only their mean and maximum."""

    max_len: int
    mean_len: float
    rows: tuple[int, ...] = ()

    @classmethod
    def of(cls, lengths: Any = None, mean_len: Any = None,
           max_len: Any = None) -> Lengths | None:
        if lengths is not None:
            rows = token_counts(lengths)
            return cls(max(rows), sum(rows) / len(rows), rows)
        if mean_len is not None or max_len is not None:
            return cls(max_len, float(mean_len))
        return None

    def padded_tokens(self, micro_batch: int) -> float:
        """Tokens a sample costs in a padded micro-batch: E[its longest row]."""
        if not self.rows:
            return float(self.max_len)
        n, seen, out = len(self.rows), 0, 0.0
        for v, k in sorted(Counter(self.rows).items()):
            below = seen / n
            seen += k
            out += v * ((seen / n) ** micro_batch - below ** micro_batch)
        return out


def length_problems(lengths: Any, mean_len: Any, max_len: Any, trainer: str | None,
                    seq_len: Any) -> list[Problem]:
    out = []
    given = [k for k, v in (("lengths", lengths), ("mean_len", mean_len),
                            ("max_len", max_len)) if v is not None]
    if not given:
        return out
    if not (trainer in TRAINERS and TRAINERS.get(trainer).lengths_plan):
        k = next(k for k in TRAINERS if k.lengths_plan)
        return [Problem(given[0], f"{given[0]} plans padding-free {k.title} batches; pass "
                                  f"trainer='{k.name}' (--trainer {k.name} on the command "
                                  "line), or seq_len=<the longest row> for padded batches")]
    if lengths is not None:
        if mean_len is not None or max_len is not None:
            out.append(Problem("lengths", "give lengths, or mean_len and max_len, not both"))
        else:
            try:
                token_counts(lengths)
            except HfMemkitError as exc:
                out.append(Problem("lengths", str(exc)))
    elif mean_len is None or max_len is None or not isinstance(max_len, int) \
            or isinstance(max_len, bool) or not 1 <= max_len <= MAX_TOKENS \
            or not isinstance(mean_len, (int, float)) or not 0 < mean_len <= max_len:
        out.append(Problem("mean_len", f"mean_len and max_len go together: 0 < mean_len <= "
                                       f"max_len (an integer <= {MAX_TOKENS}); got "
                                       f"mean_len={mean_len!r}, max_len={max_len!r}"))
    if not out and seq_len is not None:
        rule = SEQ_LEN_FROM_ROWS if lengths is not None else (
            "with mean_len and max_len, max_len is the sequence length; leave seq_len out")
        out.append(Problem("seq_len", f"{given[0]} and seq_len={seq_len!r} are both given: "
                                      f"{rule}"))
    return out


def padding_free_choices(req: Any, model_cls: type, attn: str, notes: list[str]) -> list[bool]:
    """Whether each candidate may be padded (False) or padding-free (True)."""
    if req.lengths is None:
        return [False]
    pins = req.pins
    if "padding_free" in pins or pins.get("packing"):
        return [bool(pins.get("padding_free"))]
    if attn != "flash_attention_2" and not getattr(model_cls, "_supports_attention_backend",
                                                   False):
        notes.append(f"{model_cls.__name__}'s {attn} attention does not take sequence "
                     "boundaries from position_ids: padding-free batches are not planned")
        return [False]
    return [False, True]
