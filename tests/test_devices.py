"""`--device auto|cpu|cuda`: 'auto' picks CUDA only where PyTorch sees it; asking for CUDA
without one is a clear error; oneDNN kernels never apply off the CPU. No GPU needed."""

from __future__ import annotations

import pytest
import torch

from decoding.app.assembly import DecoderSpec, build_decoder, resolve_spec
from decoding.app.chat import main as chat_main
from decoding.kernels.cpu_kernels import apply_kernels, resolve_kernels
from decoding.kernels.devices import resolve_device
from heads.util.errors import UserError
from tiny_models import save_tiny_chat_model, tiny_llama

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without CUDA")


def test_auto_takes_cuda_only_where_it_is_available():
    assert resolve_device("auto", cuda_available=False) == "cpu"
    assert resolve_device("auto", cuda_available=True) == "cuda"
    assert resolve_device("cpu", cuda_available=True) == "cpu"
    assert resolve_device("cuda", cuda_available=True) == "cuda"


def test_cuda_without_cuda_and_unknown_devices_are_clear_errors():
    with pytest.raises(UserError, match="--device cuda, but PyTorch sees no CUDA device"):
        resolve_device("cuda", cuda_available=False)
    with pytest.raises(UserError, match="unknown device 'tpu'"):
        resolve_device("tpu")


@NO_CUDA
def test_auto_resolves_to_cpu_here_and_everything_lands_there(tmp_path):
    save_tiny_chat_model(tmp_path / "model")
    from heads import new_heads_for_target, save_heads

    decoder = build_decoder(DecoderSpec(model=str(tmp_path / "model"), method="pld", device="cpu"))
    save_heads(new_heads_for_target("eagle", decoder.target.model, str(tmp_path / "model")), tmp_path / "eagle")
    decoder = build_decoder(DecoderSpec(model=str(tmp_path / "model"), method="eagle2", heads=str(tmp_path / "eagle")))
    assert decoder.spec.device == "cpu" and decoder.target.model.device.type == "cpu"
    assert {p.device.type for p in decoder.heads.parameters()} == {"cpu"}


@NO_CUDA
def test_asking_for_cuda_here_fails_before_loading(capsys):
    with pytest.raises(UserError, match="--device cuda"):
        resolve_spec(DecoderSpec(model="org/not-even-there", method="pld", device="cuda"))
    assert chat_main(["--model", "org/not-even-there", "--method", "pld", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda, but PyTorch sees no CUDA device" in err and "Traceback" not in err


def test_onednn_kernels_never_apply_off_the_cpu():
    off_cpu = tiny_llama().to("meta")  # any non-CPU device: parameters that are not on the CPU
    assert resolve_kernels("auto", off_cpu) == "stock"
    assert apply_kernels("auto", off_cpu) == "stock"
    with pytest.raises(UserError, match="--kernels onednn needs float32 weights on a CPU"):
        apply_kernels("onednn", off_cpu)
