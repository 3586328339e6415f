"""Argument errors of the references are one line naming the function and the option, also
for integers beyond a C int and numbers beyond double's range (they escaped as pybind11's
multi-line TypeError, RuntimeError or OverflowError)."""
import pytest
import torch

import k3ref
from k3ref import goldens

from conftest import needs_core

pytestmark = needs_core


@pytest.fixture(scope="module")
def x():
    return goldens.load_case("kda_t1").inputs


CALLS = [
    ("kda", "threads", lambda x: k3ref.kda(x, threads=2**70)),
    ("kda", "scale", lambda x: k3ref.kda(x, scale=2**2000)),
    ("kda_chunkwise", "chunk_size", lambda x: k3ref.kda_chunkwise(x, chunk_size=2**70)),
    ("kda_chunkwise", "sub_chunk", lambda x: k3ref.kda_chunkwise(x, chunk_form="fla", sub_chunk=2**64)),
    ("qb_solver", "k", lambda x: k3ref.qb_solver(dict(scores=torch.zeros(4, 4)), k=2**70, iterations=1)),
    ("qb_solver", "iterations", lambda x: k3ref.qb_solver(dict(scores=torch.zeros(4, 4)), k=1, iterations=2**40)),
]


@pytest.mark.parametrize("fn, option, call", CALLS, ids=[f"{f}-{o}" for f, o, _ in CALLS])
def test_an_out_of_range_option_is_one_line_naming_function_and_option(x, fn, option, call):
    with pytest.raises((TypeError, ValueError)) as info:
        call(x)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"k3ref.{fn}: option '{option}'"), text


def test_a_chunk_beyond_the_limit_is_refused_before_any_memory_is_taken(x):
    # 8192 on 4 tokens took 5 GB of C x C scratch; the chunk forms take at most 1024.
    with pytest.raises(ValueError, match=r"k3ref.kda_chunkwise: .*'chunk_size': at most 1024 .* not 8192$"):
        k3ref.kda_chunkwise(x, chunk_size=8192)
    assert k3ref.kda_chunkwise(x, chunk_size=1024)["o"].shape == x["v"].shape
