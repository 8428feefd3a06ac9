"""``diffuse host``: host a slice of a Hub model as a node, choosing it from the Hub's live search.

``diffuse host ORG/NAME [--blocks K/N] [--listen ADDR]`` is ``diffuse node`` for that model (fetching only the
slice). With no model named, a browser in the terminal over the search (``diffuse.cli.market``): each row with
Diffuse's verdict, its size and what this machine can hold of it; Enter shows a model's card, files and what each
node of a plan fetches; a key hosts the chosen slice. While the browser is up, logs and progress go to a buffer,
never over the screen.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys

KEYS_LIST = "↑↓ move · Enter details · / search · s sort · t task · q quit"
KEYS_DETAIL = "←→ choose a slice · h host it as a node (fetching only it) · Esc back"


def main(argv: list[str] | None = None) -> int:
    from diffuse.flags import Parser
    from diffuse.plan.hub import SORTS

    ap = Parser(prog="diffuse host", description="host a slice of a Hub model as a node; with no model, browse the "
                "Hub's search to choose one")
    ap.add_argument("model", nargs="?", help="ORG/NAME[@REVISION] to host (default: choose in the browser)")
    ap.add_argument("--blocks", default=None, metavar="K/N", help="the slice to hold (with a model named; default: "
                    "what the client plans at open)")
    ap.add_argument("--listen", default="tcp://0.0.0.0:7000", help="the node's control address (default "
                    "tcp://0.0.0.0:7000)")
    ap.add_argument("--search", default="", help="the browser's first search words")
    ap.add_argument("--sort", choices=list(SORTS), default="downloads", help="the browser's first order")
    ap.add_argument("--task", default=None, help="the browser's first task filter (e.g. text-to-video)")
    a = ap.parse_args(argv)
    if a.model:
        return _node(a.model, a.blocks, a.listen)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("error: diffuse host with no model browses the Hub in a terminal: run it in one, or name the model "
              "(diffuse host ORG/NAME --blocks K/N)", file=sys.stderr)
        return 2
    from diffuse.cli.market import Market

    market = Market(a.search, a.sort, a.task)
    chosen = browse(market)
    if chosen is None:
        return 0
    model, blocks = chosen
    print(f"hosting {model}, blocks {blocks}, at {a.listen}", flush=True)
    return _node(model, blocks, a.listen)


def _node(model: str, blocks: str | None, listen: str) -> int:
    from diffuse.node.command import main as node_main

    return node_main(["--model", model, "--listen", listen, *(["--blocks", blocks] if blocks else [])])


@contextlib.contextmanager
def _quiet_while_drawn():
    """Logs and stray prints kept in a buffer while the screen is drawn (said after it closes, if any)."""
    buffer = io.StringIO()
    root = logging.getLogger()
    handlers, root.handlers = root.handlers, [logging.StreamHandler(buffer)]
    stderr, sys.stderr = sys.stderr, buffer
    try:
        yield buffer
    finally:
        sys.stderr, root.handlers = stderr, handlers


def browse(market) -> tuple[str, str] | None:
    """The browser, until it is quit (None) or a slice is chosen: (ORG/NAME@COMMIT, K/N)."""
    import curses

    os.environ.setdefault("ESCDELAY", "25")
    with _quiet_while_drawn() as said:
        market.search()
        chosen = curses.wrapper(lambda screen: Browser(screen, market).run())
    kept = said.getvalue().strip().splitlines()
    if kept:  # what was said while the screen was up, said now (its last lines)
        print("\n".join(kept[-20:]), file=sys.stderr)
    return chosen


class Browser:
    """The list of models and one model's page; remembers the list's place while a page is open."""

    def __init__(self, screen, market):
        self.screen, self.market = screen, market
        self.cursor = self.top = 0
        self.page = None  # the row whose page is open
        self.details: dict = {}
        self.choice = 0

    def run(self):
        import curses

        curses.curs_set(0)
        self.screen.timeout(200)  # redrawn as the background judging fills rows in
        while True:
            self.draw()
            key = self.screen.getch()
            if key == -1:
                continue
            done, result = (self.on_page(key) if self.page else self.on_list(key))
            if done:
                return result

    def on_list(self, key: int):
        import curses

        rows = self.market.rows
        if key in (ord("q"), 27):
            return True, None
        if key in (curses.KEY_DOWN, ord("j")) and self.cursor + 1 < len(rows):
            self.cursor += 1
        elif key in (curses.KEY_UP, ord("k")) and self.cursor > 0:
            self.cursor -= 1
        elif key in (curses.KEY_ENTER, 10, 13) and rows:
            self.page, self.choice = rows[self.cursor], 0
            self.status("reading its files…")
            self.details = self.market.details(self.page)
        elif key == ord("/"):
            self.market.words = self.ask("search: ")
            self.research()
        elif key == ord("s"):
            from diffuse.plan.hub import SORTS

            names = list(SORTS)
            self.market.sort = names[(names.index(self.market.sort) + 1) % len(names)]
            self.research()
        elif key == ord("t"):
            from diffuse.cli.market import TASKS

            self.market.task = TASKS[(TASKS.index(self.market.task) + 1) % len(TASKS)]
            self.research()
        return False, None

    def on_page(self, key: int):
        import curses

        slices = list(self.details.get("plans", {}))
        if key == 27:
            self.page = None  # back to the list, where it was
        elif key in (curses.KEY_RIGHT, ord("l")) and slices:
            self.choice = (self.choice + 1) % len(slices)
        elif key in (curses.KEY_LEFT, ord("h") - 32) and slices:
            self.choice = (self.choice - 1) % len(slices)
        elif key == ord("h") and slices:
            return True, (f"{self.page.repo}@{self.page.commit}", slices[self.choice])
        return False, None

    def research(self) -> None:
        self.cursor = self.top = 0
        self.status("searching…")
        self.market.search()

    def ask(self, prompt: str) -> str:
        import curses

        h, _ = self.screen.getmaxyx()
        self.screen.move(h - 1, 0)
        self.screen.clrtoeol()
        self.screen.addstr(h - 1, 0, prompt)
        curses.echo()
        self.screen.timeout(-1)
        try:
            words = self.screen.getstr(h - 1, len(prompt), 60).decode("utf-8", "replace")
        finally:
            curses.noecho()
            self.screen.timeout(200)
        return words.strip()

    def status(self, text: str) -> None:
        h, w = self.screen.getmaxyx()
        self.put(h - 1, text, w)
        self.screen.refresh()

    def put(self, y: int, text: str, width: int, attr: int = 0) -> None:
        try:
            self.screen.addnstr(y, 0, text.ljust(width - 1), width - 1, attr)
        except Exception:  # the last cell of a small screen: nothing to draw there
            pass

    def draw(self) -> None:
        self.screen.erase()
        h, w = self.screen.getmaxyx()
        lines = self.page_lines() if self.page else self.list_lines(h - 4)
        m = self.market
        self.put(0, f"diffuse host · search {m.words!r} · sort {m.sort} · task {m.task or 'all'}", w)
        self.put(1, m.machine.line(), w)
        for i, (text, strong) in enumerate(lines[: h - 3]):
            self.put(2 + i, text, w, _reverse() if strong else 0)
        self.put(h - 1, KEYS_DETAIL if self.page else KEYS_LIST, w)
        self.screen.refresh()

    def list_lines(self, room: int) -> list[tuple[str, bool]]:
        from diffuse.cli.market import size_text

        rows = self.market.rows
        if self.market.error:
            return [(self.market.error, False)]
        if not rows:
            return [("no model matches", False)]
        self.top = min(max(self.top, self.cursor - room + 2), self.cursor)
        out = [(f"  {'model':<34} {'downloads':>10}  {'task':<16} {'size':>9}  {'this machine holds':<22} verdict",
                False)]
        for i, r in enumerate(rows[self.top: self.top + room - 1], start=self.top):
            mark = ">" if i == self.cursor else " "
            out.append((f"{mark} {r.repo:<34.34} {r.downloads:>10,}  {(r.task or '-'):<16.16} "
                        f"{size_text(r.size) if r.judged else '…':>9}  {r.holds:<22.22} {r.verdict}",
                        i == self.cursor))
        return out

    def page_lines(self) -> list[tuple[str, bool]]:
        from diffuse.cli.market import size_text

        r, d = self.page, self.details
        out = [(f"{r.repo}@{r.commit[:12]} · {r.task or '-'} · {r.downloads:,} downloads · {r.likes:,} likes", True),
               (f"verdict: {r.verdict}", False), (f"size {size_text(r.size)}; this machine holds {r.holds}", False),
               ("", False), ("card:", False)]
        out += [(f"  {ln}", False) for ln in d.get("card", [])]
        out += [("", False), ("files:", False)]
        out += [(f"  {size_text(n):>9}  {p}", False) for p, n in d.get("files", [])[:8]]
        plans = d.get("plans", {})
        if plans:
            out += [("", False), ("what a node fetches (its blocks' tensors, as stored):", False)]
            chosen = list(plans)[self.choice]
            out += [("  " + "  ".join(f"[{k} {size_text(b)}]" if k == chosen else f" {k} {size_text(b)} "
                                       for k, b in plans.items() if k.endswith(f"/{n}")), False)
                    for n in sorted({k.split("/")[1] for k in plans})]
            out += [(f"h hosts blocks {chosen} of {r.repo}@{r.commit[:12]} here", True)]
        return out


def _reverse() -> int:
    import curses

    return curses.A_REVERSE
