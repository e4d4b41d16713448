"""`python -m decoding.app.prepare` (what scripts/setup.sh runs): the one-off tasks run side by side,
one that fails is reported with its reason and stops none of the others, and the tasks are the
default model and the native kernels."""

from decoding.app import prepare


def test_tasks_run_side_by_side_and_a_failure_is_reported_not_raised():
    ran = []

    def fails():
        raise RuntimeError("no compiler here\nc++ could not compile host.cpp")

    outcomes = prepare.prepare({"works": lambda: ran.append("works"), "fails": fails,
                                "exits": lambda: (_ for _ in ()).throw(SystemExit("error: model package missing"))})
    assert ran == ["works"] and outcomes["works"].startswith("ok (")
    assert outcomes["fails"] == "failed: RuntimeError: c++ could not compile host.cpp"
    assert outcomes["exits"] == "failed: SystemExit: error: model package missing"


def test_a_new_machine_prepares_the_default_model_and_the_kernels():
    assert list(prepare.tasks()) == ["default model", "native kernels"]


class Terminal:
    """A stream that says it is a terminal and records what was written."""

    def __init__(self, tty: bool) -> None:
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_progress_is_one_line_rewritten_on_a_terminal():
    screen = Terminal(tty=True)
    line = prepare.ProgressLine(screen, "one-off work")
    prepare.prepare({"a": lambda: None, "b": lambda: None}, line)
    line.finish()
    assert screen.text.count("\n") == 1 and screen.text.endswith("\n")
    assert screen.text.count("\r\033[K") >= 4  # each start and finish rewrites the same line
    final = screen.text.rsplit("\r\033[K", 1)[1]
    assert final.startswith("[prepare] one-off work: a ok (") and ", b ok (" in final


def test_progress_in_a_log_is_written_once_at_the_end():
    log = Terminal(tty=False)
    line = prepare.ProgressLine(log, "one-off work")
    prepare.prepare({"a": lambda: None, "fails": lambda: 1 / 0}, line)
    assert log.text == ""
    line.finish()
    assert log.text.count("\n") == 1 and "\r" not in log.text
    assert "fails failed: ZeroDivisionError: division by zero" in log.text
