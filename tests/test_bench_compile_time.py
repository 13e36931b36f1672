"""benchmarks/compile_time.py counts what dynamo interprets and reads its tracing time: both
must follow the code traced (more Python traced, more instructions; nothing traced, nothing
counted)."""
import torch
import torch._dynamo

from compile_time import InstructionCount, tracing_seconds


def _short(x):
    return x + 1


def _long(x):
    for _ in range(20):
        x = x + 1
    return x


def counted(fn) -> tuple[int, float]:
    torch._dynamo.reset()
    before = tracing_seconds()
    with InstructionCount() as count:
        torch.compile(fn, backend="eager", fullgraph=True)(torch.zeros(3))
    return count.n, tracing_seconds() - before


def test_instructions_and_tracing_time_grow_with_the_code_traced():
    short, short_s = counted(_short)
    long, long_s = counted(_long)
    assert 0 < short < long, (short, long)
    assert long_s > 0.0
    with InstructionCount() as count:  # a compiled function that is not retraced counts nothing
        torch.zeros(3) + 1
    assert count.n == 0
