"""While the live view owns the terminal, log lines are held and said after it closes, in order."""

from __future__ import annotations

import io
import logging

from moescope.agent.observe import HeldLogs


def test_held_lines_reach_the_original_handlers_after_release() -> None:
    root = logging.getLogger()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    saved_handlers, saved_level = list(root.handlers), root.level
    for h in saved_handlers:
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        held = HeldLogs(max_records=3)
        held.capture()
        for i in range(5):
            logging.getLogger("moescope.test").warning("line %d", i)
        assert out.getvalue() == ""  # nothing tears the view
        held.replay()
        lines = out.getvalue().splitlines()
        assert lines[0] == "WARNING 2 log lines dropped while the live view was up (the oldest)"
        assert lines[1:] == ["WARNING line 2", "WARNING line 3", "WARNING line 4"]
        assert root.handlers == [handler]
        logging.getLogger("moescope.test").warning("after")
        assert out.getvalue().splitlines()[-1] == "WARNING after"
    finally:
        root.removeHandler(handler)
        for h in saved_handlers:
            root.addHandler(h)
        root.setLevel(saved_level)
