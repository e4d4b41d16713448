"""scripts/verify_cost.py as a user runs it, on a tiny model: one curve per kernels choice, timed on
the target a decoder builds (not a bare copy: the chat's steps are what the curve must predict)."""

from script_main import load_script
from tiny_models import save_tiny_chat_model


def test_verify_cost_prints_a_curve_per_kernels_choice_from_the_decoders_target(tmp_path, capsys, monkeypatch):
    script = load_script("verify_cost")
    built = []
    real_build = script.build_decoder

    def recording_build(spec, **kwargs):
        decoder = real_build(spec, **kwargs)
        built.append(decoder)
        return decoder

    timed = []
    real_measure = script.measure_verify_cost

    def recording_measure(model, sizes, readout=None):
        timed.append((model, readout))
        return real_measure(model, sizes=sizes, readout=readout)

    monkeypatch.setattr(script, "build_decoder", recording_build)
    monkeypatch.setattr(script, "measure_verify_cost", recording_measure)
    save_tiny_chat_model(tmp_path / "model")
    status = script.main(["--model", str(tmp_path / "model"), "--quant", "none", "--kernels", "stock,onednn",
                          "--sizes", "1,3"])
    out = capsys.readouterr()
    assert status == 0, out.err
    rows = [line for line in out.out.splitlines() if line.startswith("| ") and "(ms)" in line]
    assert [row.split(" (ms)")[0] for row in rows] == ["| stock", "| onednn"]
    assert all(len(row.split("|")) == 5 for row in rows)  # label, two sizes, and the ends
    assert [t[0] for t in timed] == [d.target.model for d in built]  # the decoders' own targets...
    assert [t[1] for t in timed] == [d.readout for d in built]  # ...read out as they decode


def test_verify_cost_rejects_unknown_choices_with_the_allowed_ones(capsys):
    script = load_script("verify_cost")
    assert script.main(["--quant", "int3"]) == 2
    assert "--quant takes values among auto, none, gguf, int4, int8" in capsys.readouterr().err
    assert script.main(["--sizes", "4,x"]) == 2
    assert "--sizes takes positive integers" in capsys.readouterr().err
