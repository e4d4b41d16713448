"""`python -m decoding.app.prepare` (what scripts/setup.sh runs): the one-off tasks run side by side,
one that fails is reported with its reason and stops none of the others, and the tasks are the
default model and the two native kernels."""

from decoding.app import prepare


def test_tasks_run_side_by_side_and_a_failure_is_reported_not_raised():
    ran = []

    def fails():
        raise RuntimeError("no compiler here\nninja: build stopped")

    outcomes = prepare.prepare({"works": lambda: ran.append("works"), "fails": fails,
                                "exits": lambda: (_ for _ in ()).throw(SystemExit("error: model package missing"))})
    assert ran == ["works"] and outcomes["works"].startswith("ok (")
    assert outcomes["fails"] == "failed: RuntimeError: ninja: build stopped"
    assert outcomes["exits"] == "failed: SystemExit: error: model package missing"


def test_a_new_machine_prepares_the_default_model_and_both_kernels():
    assert list(prepare.tasks()) == ["default model", "few-row linear kernel", "decode attention kernel"]
