"""Time one streaming flush of a long answer in the conversation view.

    QT_QPA_PLATFORM=offscreen python scripts/bench_streaming.py [--before REV]

Streams a Markdown answer (paragraphs, lists, code) into a ``ConversationView``
token by token, a flush every ``TOKENS_PER_FLUSH`` tokens (about 30 ms of decode
at 100 tok/s), and prints the median and worst flush (``ChatModel.flush`` and
the events it posts) around the 500th, 1,000th, 2,000th and 4,000th token. With
``--before REV`` the view uses ``app/chat/markdown_view.py`` as it was at REV,
so one run compares the two in the same process and machine state.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types

from PySide6.QtWidgets import QApplication

TOKENS_PER_FLUSH = 3
AT = (500, 1000, 2000, 4000)
SAMPLES = 15  # flushes timed after each mark
BLOCKS = (
    "Pines keep their needles for years, and the **longleaf** keeps them longest. ",
    "\n\n- sandy soil\n- salt wind\n- fire every few years\n\n",
    "A cone opens in the heat; the seeds fall on bare ground. ",
    "\n\n```python\ndef age(rings):\n    return len(rings)\n```\n\n",
    "The stand thins itself as it grows, and the survivors grow tall. ",
    "\n\n",
)


def tokens():
    """Pieces of about four characters, as a tokenizer would stream them."""
    while True:
        for block in BLOCKS:
            for start in range(0, len(block), 4):
                yield block[start:start + 4]


def old_markdown_view(rev: str):
    """``MarkdownView`` from ``app/chat/markdown_view.py`` at ``rev``."""
    source = subprocess.run(["git", "show", f"{rev}:app/chat/markdown_view.py"], check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("markdown_view_before")
    exec(compile(source, "markdown_view_before", "exec"), module.__dict__)
    return module.MarkdownView


def run(view_class=None) -> dict[int, tuple[float, float]]:
    """Median and worst flush in ms after each mark in ``AT``."""
    import app.chat.conversation_view as conversation_view
    from app.chat.model import ChatMessage, ChatModel

    if view_class is not None:
        conversation_view.MarkdownView = view_class
    model = ChatModel()
    view = conversation_view.ConversationView(model)
    view.resize(800, 700)
    view.show()
    model.append(ChatMessage("user", "Tell me about pines.", "complete", 1))
    model.append(ChatMessage("assistant", "", "streaming", 2))
    app = QApplication.instance()
    stream, times, count = tokens(), {mark: [] for mark in AT}, 0
    while count < AT[-1] + SAMPLES * TOKENS_PER_FLUSH:
        for _ in range(TOKENS_PER_FLUSH):
            model.append_text(next(stream))
        count += TOKENS_PER_FLUSH
        started = time.perf_counter()
        model.flush()
        app.processEvents()
        elapsed = (time.perf_counter() - started) * 1000
        for mark in AT:
            if mark <= count < mark + SAMPLES * TOKENS_PER_FLUSH:
                times[mark].append(elapsed)
    view.close()
    return {mark: (statistics.median(t), max(t)) for mark, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="git revision whose markdown_view.py to time as well")
    args = parser.parse_args()
    app = QApplication.instance() or QApplication(sys.argv)  # noqa: F841 - kept alive
    rows = [("now", run())]
    if args.before:
        rows.insert(0, (f"at {args.before}", run(old_markdown_view(args.before))))
    print("| markdown_view | " + " | ".join(f"token {m:,}" for m in AT) + " |")
    print("|---|" + "---|" * len(AT))
    for name, result in rows:
        cells = " | ".join(f"{med:.1f} ms (worst {worst:.1f})" for med, worst in result.values())
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
