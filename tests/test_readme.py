"""README.md's Python blocks run, as written, on small inputs.

Every ```python block is extracted and executed after a preamble that defines the small inputs
the blocks assume (`k_cache`, `q`, `block_tables`, ...: JAX arrays, or torch tensors for a block
that imports `torch_ref`). A block that builds a device mesh runs in a subprocess with 4 virtual
CPU devices (``--xla_force_host_platform_device_count=4``). After a block, an ``out`` it defines
must have the query's shape.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)

# Small inputs: 2 sequences of 5 and 9 tokens (blocks of 4, in a shuffled order), their newest
# token (written by the block) at slots 13 and 25; 4 query heads over 2 kv heads of width 16.
PREAMBLE = textwrap.dedent("""
    import numpy as np
    import ml_dtypes
    _rng = np.random.default_rng(0)
    _bf16 = ml_dtypes.bfloat16
    _np = dict(
        k_cache=_rng.standard_normal((8, 4, 2, 16)).astype(_bf16),
        v_cache=_rng.standard_normal((8, 4, 2, 16)).astype(_bf16),
        k=_rng.standard_normal((2, 2, 16)).astype(_bf16),
        v=_rng.standard_normal((2, 2, 16)).astype(_bf16),
        slot_mapping=np.array([13, 25], np.int32),
        q=_rng.standard_normal((2, 4, 16)).astype(_bf16),
        block_tables=np.array([[2, 3, 7], [5, 6, 1]], np.int32),
        context_lens=np.array([6, 6], np.int32),
        slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32),
        sinks=np.array([0.0, 1.0, -1.0, 0.5], np.float32),
    )
    if {torch}:
        from parity import convert as _convert
        globals().update({{name: _convert.to_torch(x, "cpu") for name, x in _np.items()}})
    else:
        import jax.numpy as _jnp
        globals().update({{name: _jnp.asarray(x) for name, x in _np.items()}})
""")
EPILOGUE = textwrap.dedent("""
    if "out" in globals():
        assert tuple(out.shape) == (2, 4, 16), out.shape
""")


def readme_blocks() -> list[str]:
    return BLOCK.findall(README.read_text())


def needs_devices(block: str) -> bool:
    return "Mesh(" in block or "jax.devices()" in block


def program(block: str) -> str:
    uses_torch = re.search(r"^import .*\btorch_ref\b", block, re.M) is not None
    return PREAMBLE.format(torch=uses_torch) + block + EPILOGUE


BLOCKS = readme_blocks()


def test_readme_has_the_blocks():
    """README keeps its blocks: a device mesh one and a torch_ref one among them."""
    assert len(BLOCKS) >= 4
    assert any(needs_devices(b) for b in BLOCKS) and any("torch_ref" in b for b in BLOCKS)


def is_slow(block: str) -> bool:
    """A block that builds a device mesh (a subprocess) or runs the ragged kernel (its interpret
    mode compiles for most of a minute on a 2-core CPU) is in the slow set."""
    return needs_devices(block) or "paged_attention(" in block


@pytest.mark.parametrize("index", [
    pytest.param(i, id=f"block{i}-{b.strip().splitlines()[0][:30]}",
                 marks=[pytest.mark.slow] if is_slow(b) else []) for i, b in enumerate(BLOCKS)])
def test_readme_block_runs(index):
    """The block runs as written on the preamble's small inputs; an ``out`` it defines has the
    query's shape."""
    block = BLOCKS[index]
    if not needs_devices(block):
        exec(compile(program(block), f"README.md python block {index}", "exec"), {})
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    result = subprocess.run([sys.executable, "-c", program(block)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"README block {index} failed:\n{result.stderr[-4000:]}"
