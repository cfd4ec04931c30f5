"""The lines ``hf-memkit estimate --max-batch`` and ``--max-seq-len`` print: the answer, what
it needs against the budget and what the next size needs."""

from __future__ import annotations


def batch_reason(answer, seq_len: int) -> str:
    """``--max-batch``'s line: the answer, the memory it needs against the budget, and what
    the next size needs (or why it is the answer without one)."""
    from .._units import format_bytes

    budget = format_bytes(answer.budget)
    if answer.batch == 0:
        return (f"no micro-batch fits at seq_len {seq_len}: 1 needs "
                f"{format_bytes(answer.next_needed or 0)}, the budget is {budget}")
    head = (f"max micro-batch {answer.batch} at seq_len {seq_len}: "
            f"{format_bytes(answer.needed)} of {budget} budget")
    if answer.next_batch is None:
        return f"{head}; {answer.batch} is the largest size tried"
    if answer.next_needed is None:
        return f"{head}; {answer.next_batch} cannot be estimated: {answer.next_error}"
    return f"{head}; {answer.next_batch} needs {format_bytes(answer.next_needed)}"


def seq_len_reason(answer, trainer: str | None) -> str:
    """``--max-seq-len``'s lines: the answer, what it needs with the margin it holds back
    against the budget (and where the budget comes from), what the next length needs, and how
    the trainer's step differs from ``transformers.Trainer``'s.

    Args:
        answer (`SeqLenAnswer`): ``_plan.reverse.max_seq_len_answer``'s.
        trainer (`str`, *optional*): ``--trainer`` (None: ``transformers.Trainer``).

    Returns:
        `str`: one line, plus one about the trainer where its step differs.
    """
    from .._trainers import TRAINER, TRAINERS
    from .._units import format_bytes as fb

    step = f"multiples of {answer.step} up to {answer.limit}"
    if answer.seq_len == 0:
        head = (f"no seq_len fits ({step}): {answer.step} tokens need "
                f"{fb(answer.next_needed) if answer.next_needed else 'more'} with the margin, "
                f"the budget is {fb(answer.budget)}")
    else:
        head = (f"longest seq_len that fits ({step}): {answer.seq_len}; it needs "
                f"{fb(answer.needed)} with a margin of {fb(answer.margin)} held back "
                f"(2 sigma of the estimate), of a {fb(answer.budget)} budget "
                f"({answer.budget_basis})")
        if answer.next_len is None:
            head += f"; {answer.seq_len} is the longest tried (raise --seq-len)"
        elif answer.next_needed is not None:
            head += f"; {answer.next_len} needs {fb(answer.next_needed)}"
        else:
            head += f"; {answer.next_len} cannot be estimated: {answer.next_error}"
    kind = TRAINERS.get(trainer or TRAINER.name)
    return head + (f"\n{kind.title}: {kind.memory_difference}" if kind.memory_difference else "")
