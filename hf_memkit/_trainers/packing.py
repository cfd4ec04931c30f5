"""The tokens of the largest micro-batch ``SFTTrainer`` feeds, from the rows' token counts.

``estimate_memory(..., lengths=[...])`` passes the dataset's row lengths (in dataset order):
  * **packing** ("bfd" / "bfd_split", TRL 1.16 ``trl/data_utils.py::_pack_bfd``): rows are
    truncated (``bfd``) or split (``bfd_split``) at ``max_length``, sorted longest first and each
    put into the bin whose free space fits it most tightly (best fit decreasing; ties: the bin
    that got that free space first), a new bin when none fits. ``pack_dataset`` runs it through
    ``datasets.map(batched=True)``, 1000 rows per batch, so bins never mix rows of two batches.
    A micro-batch is ``per_device_train_batch_size`` bins flattened into one row; the sampler
    shuffles bins, so the largest micro-batch holds the fullest bins;
  * **padding-free** without packing: the rows themselves are flattened, so the largest
    micro-batch holds the longest rows (TRL requires ``max_length=None`` there: rows are not
    truncated).
Both are the most a step can be handed over an epoch: an upper bound for any one shuffle, exact
for the worst.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import HfMemkitError, quoted

MAP_BATCH = 1000  # datasets.Dataset.map's default batch_size
# The most tokens one row (or sequence) may hold: above the longest contexts models train on
# today (10M tokens), far below what a traced tensor's size can hold (a 10**26-token row
# overflowed deep in torch).
MAX_TOKENS = 2**24
# The most samples in one micro-batch, one accumulation or one optimizer step: far above the
# largest batches published (65,536 sequences, BERT pre-training with LAMB), low enough that a
# traced tensor's size and the planner's search over its divisors stay small.
MAX_BATCH = 2**20
# one rule for estimate_memory and plan_training
SEQ_LEN_FROM_ROWS = ("with lengths the longest row is the sequence length; leave seq_len out "
                     "(--seq-len on the command line)")
_LENGTHS = ("lengths must be the token counts of the dataset's rows, in dataset order: a list, "
            f"tuple or 1-D array of positive integers (at most {MAX_TOKENS} = 2**24 each)")


def _not_a_sequence(lengths: Any) -> str | None:
    """Why ``lengths`` is not a sequence of counts (a dict, a set, a string), or None."""
    if isinstance(lengths, (str, bytes)):
        return ("a string; pass a list of integers (on the command line: --lengths FILE, one "
                "count per line)")
    if isinstance(lengths, Mapping):
        return ("a dict (its keys would be read as the counts); pass list(d.values()) if its "
                "values are the counts")
    if isinstance(lengths, (set, frozenset)):
        return "a set (no order, equal counts merged); pass a list in dataset order"
    return None


def _count(v: Any) -> int | None:
    """``v`` as an int: Python, NumPy and 0-d torch integers (never a bool), else None."""
    if isinstance(v, bool) or str(getattr(v, "dtype", "")).endswith("bool"):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def token_counts(lengths: Any) -> tuple[int, ...]:
    """``lengths=`` (``estimate_memory``, ``plan_training``) as a tuple of ints: any sequence
    or 1-D array of integral numbers (NumPy and torch integers included), each in
    [1, ``MAX_TOKENS``]. ``HfMemkitError`` naming what was given otherwise."""
    why = _not_a_sequence(lengths)
    try:
        items = list(lengths) if why is None else []
    except TypeError:  # not iterable: an int, a 0-d array
        why = f"{quoted(lengths)} ({type(lengths).__name__})"
    if why:
        raise HfMemkitError(f"{_LENGTHS}; got {why}")
    if not items:
        raise HfMemkitError(f"{_LENGTHS}; got an empty {type(lengths).__name__}")
    rows, bad = [], []
    for v in items:
        n = _count(v)
        if n is None or not 1 <= n <= MAX_TOKENS:
            bad.append(quoted(v, 40) if n is None else str(n) if n < 1 else f"{n:.3g}")
        rows.append(n)
    if bad:
        raise HfMemkitError(f"{_LENGTHS}; got {len(bad)} that are not: "
                            f"[{', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}]")
    return tuple(rows)


def _fragments(lengths: Sequence[int], max_length: int, split: bool) -> list[int]:
    if not split:
        return [min(n, max_length) for n in lengths if n > 0]
    out = []
    for n in lengths:
        q, r = divmod(n, max_length)
        out += [max_length] * q + ([r] if r else [])
    return out


def bfd_bins(lengths: Sequence[int], max_length: int, *, split: bool = False) -> list[int]:
    """The token count of every bin ``_pack_bfd`` makes of rows of ``lengths``, per map batch."""
    bins: list[int] = []
    for start in range(0, len(lengths), MAP_BATCH):
        used: list[int] = []                  # tokens in each bin of this map batch
        free: list[tuple[int, int]] = []      # (free space, order it got it) of open bins
        order = itertools.count()
        where: dict[int, int] = {}            # order -> bin index
        for n in sorted(_fragments(lengths[start:start + MAP_BATCH], max_length, split),
                        reverse=True):
            i = bisect.bisect_left(free, (n, -1))
            if i < len(free):
                _, o = free.pop(i)
                b = where.pop(o)
            else:
                b = len(used)
                used.append(0)
            used[b] += n
            if max_length - used[b] > 0:
                o = next(order)
                where[o] = b
                bisect.insort(free, (max_length - used[b], o))
        bins += used
    return bins


def peak_tokens(lengths: Sequence[int], micro_batch: int, *, packing: bool, max_length: int | None,
                split: bool = False) -> int:
    """The tokens of the largest padding-free micro-batch of ``micro_batch`` bins (or rows)."""
    units = bfd_bins(lengths, max_length, split=split) if packing and max_length else \
        list(lengths)
    return sum(sorted(units, reverse=True)[:micro_batch])


def with_lengths(setup, lengths: Sequence[int] | None, seq_len: int | None):
    """``setup`` and ``seq_len`` for rows of ``lengths`` tokens (None: as they are): a padded
    batch peaks at its longest row (truncated at ``max_length``); a padding-free SFT micro-batch
    holds the tokens of its largest micro-batch (``peak_tokens``), kept in the trainer's
    options."""
    from .._errors import ConfigError
    from .._techniques import TechniqueUse

    if lengths is None:
        return setup, seq_len
    try:
        lengths = token_counts(lengths)
    except HfMemkitError as exc:
        raise ConfigError([str(exc)], source="estimate_memory") from None
    if seq_len is not None:
        raise ConfigError([f"lengths and seq_len={seq_len} are both given: {SEQ_LEN_FROM_ROWS}"],
                          source="estimate_memory")
    o = setup.trainer_options
    cap = o.get("max_length")
    longest = min(max(lengths), cap) if cap else max(lengths)
    kind = setup.trainer_kind
    if not kind.lengths_plan or not o.get("padding_free"):
        return setup, seq_len or longest
    split = o.get("packing_strategy") == "bfd_split"
    o["tokens"] = peak_tokens(lengths, setup.micro_batch, packing=bool(o.get("packing")),
                              max_length=cap, split=split)
    before = set(kind.notes(setup.trainer_options))
    notes = tuple(n for n in setup.notes if n not in before) + tuple(kind.notes(o))
    return setup.replace(trainer=TechniqueUse.of(kind.name, o), notes=notes), seq_len or longest
