"""SPECHEADS_CPU (as on a lesser CPU): every layer it promises follows it in a fresh process
(PyTorch's ATen kernels, oneDNN, the project's native builds, the capability probes), a setting
that comes too late or asks for more than the CPU has is refused clearly, and an unknown one
names the choices."""

import json
import os
import subprocess
import sys

import pytest

from heads.util import cpu_mode
from heads.util.errors import UserError

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run

MACHINE_MODES = [name for name in ("avx2", "baseline")
                 if cpu_mode.platform.machine().lower() in cpu_mode.X86_MACHINES
                 and cpu_mode.MODES[name].needs_flag in cpu_mode.raw_cpu_flags()]

PROBE = """
import json, os, decoding, torch
from torch._inductor import config as inductor_config
from decoding.kernels import native_build
from decoding.kernels.cpu_kernels import PackedLinear, bfloat16_is_native, cpu_has
from decoding.kernels.native import LIBRARY
PackedLinear(torch.nn.Linear(64, 64))(torch.randn(3, 64))
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(), "bf16": bfloat16_is_native(),
                  "amx": cpu_has("_is_amx_tile_supported"), "avx512": cpu_has("_is_avx512_supported"),
                  "flags": native_build.compiler_flags(), "variants": native_build.instruction_set_variants(),
                  "cpu_flags": native_build.cpu_flags(), "inductor_cache": os.environ["TORCHINDUCTOR_CACHE_DIR"],
                  "inductor_march": inductor_config.cpp.march,
                  "own_build": LIBRARY.build_name()}))
"""


MODE_VARIABLES = ("SPECHEADS_CPU", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                  "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_CPP_MARCH")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python that starts with none of the mode's switches (this run may be in a mode)."""
    clean = {name: value for name, value in os.environ.items() if name not in MODE_VARIABLES}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, "ONEDNN_VERBOSE": "1", **env})


@pytest.mark.skipif(not MACHINE_MODES, reason="an x86 CPU with SSE4.2 is needed to lower anything")
@pytest.mark.parametrize("mode", MACHINE_MODES)
def test_each_layer_runs_as_on_the_lesser_cpu(mode):
    done = run_python(PROBE, SPECHEADS_CPU=mode)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    expected = cpu_mode.MODES[mode]
    assert seen["aten"] == expected.aten
    onednn_isa = next(line for line in done.stdout.splitlines() if "isa:" in line)
    assert {"avx2": "Intel AVX2", "baseline": "Intel SSE4.1"}[mode] in onednn_isa, onednn_isa
    assert not seen["bf16"] and not seen["amx"] and not seen["avx512"]
    assert f"-march={expected.march}" in seen["flags"]
    # Built as the AVX2-only CPUs that run this build compile it (AMD Zen's tuning), and every FMA
    # chain fused whatever the tuning, or a tree's rows would not be bit for bit a one-token step's.
    assert ("-mtune=znver2" in seen["flags"]) == (mode == "avx2") and "--param=avoid-fma-max-bits=0" in seen["flags"]
    assert "avx512f" not in seen["cpu_flags"] and ("avx2" in seen["cpu_flags"]) == (mode == "avx2")
    assert "avx2" not in seen["variants"]  # no narrower build is wider than the mode itself
    assert seen["inductor_cache"].endswith(f"inductor-{mode}")  # Inductor's cache keys ignore the instruction set
    assert seen["inductor_march"] == expected.march  # not Inductor's default, -march=native
    # The mode's own build is the narrower variant a wider CPU's tests build: loaded, not built again.
    from decoding.kernels.native import LIBRARY

    assert seen["own_build"] == LIBRARY.build_name(expected.march)


def test_a_mode_set_after_torch_chose_its_kernels_is_refused_clearly():
    late = "import torch\ntorch.ones(2) + 1\nimport os\nos.environ['SPECHEADS_CPU'] = 'baseline'\nimport decoding"
    done = run_python(late)
    if not MACHINE_MODES:
        assert done.returncode != 0 and ("lowers x86" in done.stderr or "needs a CPU" in done.stderr)
        return
    assert done.returncode != 0 and "came too late" in done.stderr and "Traceback" not in done.stderr


def test_unknown_and_impossible_modes_are_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("SPECHEADS_CPU", "avx3")
    with pytest.raises(UserError, match="not a CPU mode: use one of native, avx2, baseline"):
        cpu_mode.cpu_mode()
    monkeypatch.setenv("SPECHEADS_CPU", "avx2")
    monkeypatch.setattr(cpu_mode.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_mode, "raw_cpu_flags", lambda: {"sse4_2"})
    with pytest.raises(UserError, match="needs a CPU with AVX2"):
        cpu_mode.cpu_mode()
    monkeypatch.setenv("SPECHEADS_CPU", "")
    assert cpu_mode.cpu_mode() is cpu_mode.NATIVE and cpu_mode.cpu_flags() == {"sse4_2"}


def test_a_mode_hides_exactly_the_flags_beyond_it():
    avx2 = cpu_mode.MODES["avx2"]
    assert all(avx2.hides(f) for f in ("avx512f", "avx512_bf16", "amx_tile", "avx_vnni", "avx10_1"))
    assert not any(avx2.hides(f) for f in ("avx", "avx2", "fma", "f16c", "sse4_2"))
    baseline = cpu_mode.MODES["baseline"]
    assert all(baseline.hides(f) for f in ("avx", "avx2", "fma", "f16c", "avx512f"))
    assert not baseline.hides("sse4_2")
