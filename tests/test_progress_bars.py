"""Progress reporters at the scale of a 512-GPU run (512 rank files, each a task), and as they were
for a handful: logs get one line for all the tasks instead of a thousand, a terminal's bars stay
within its height, process 0's job log says the same in the same words. No real composition:
events as workers emit them, a fake clock and a fake terminal."""

from __future__ import annotations

import io
import re
from os import terminal_size

from tailor_tui.events import TaskFinished, TaskProgressed
from tailor_tui.progress_bars import FEW, BarReporter, LineReporter, Tally, reporter_for
from tailor_tui.team.progress import JobLines
from tailor_tui.units import size, throughput

RANK = 8704  # 8.5 KiB: a rank file of the 512-rank composition


class Clock:
    """Fake monotonic time: each reading advances it by `step` seconds."""

    def __init__(self, step: float = 0.0):
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def tasks(n: int, total: int = RANK) -> list[tuple[str, int]]:
    return [(f"rank {i}", total) for i in range(n)]


def events(planned: list[tuple[str, int]], parallel: int = 2, steps: int = 4):
    """What `ByteCounter`s emit for `planned`, `parallel` tasks at a time: 0, a few steps, the
    total, then TaskFinished."""
    for first in range(0, len(planned), parallel):
        group = planned[first:first + parallel]
        for name, total in group:
            yield TaskProgressed(name, 0, total)
        for step in range(1, steps):
            for name, total in group:
                yield TaskProgressed(name, total * step // steps, total)
        for name, total in group:
            yield TaskProgressed(name, total, total)
            yield TaskFinished(name, total)


def feed(reporter, stream) -> None:
    for event in stream:
        reporter(event)


# --- a handful of tasks: as before ----------------------------------------------------------------


def test_few_tasks_print_each_task_lines_as_before():
    for given in (tasks(2), ()):  # known up front, or seen as they come
        out = io.StringIO()
        feed(LineReporter(out, tasks=given, clock=Clock()), events(tasks(2), steps=2))
        assert out.getvalue().splitlines() == [
            "rank 0: 0% 0 Bytes/8.5 KiB written",
            "rank 1: 0% 0 Bytes/8.5 KiB written",
            "rank 0: 50% 4.2 KiB/8.5 KiB written",
            "rank 1: 50% 4.2 KiB/8.5 KiB written",
            "rank 0: done, 8.5 KiB written",
            "rank 1: done, 8.5 KiB written",
        ]


def test_a_cloned_task_says_what_it_wrote_and_what_shares_the_base_blocks():
    """A clone's bytes are composed without being written: its progress counts them "composed", its
    last line and the summary's last say how many were written, in the words of the final result."""
    cloned = [(name, total) for name, total in tasks(FEW + 1)]
    stream = [TaskFinished(e.task, e.total, shared=e.total - 1024, shared_how="reflink")
              if isinstance(e, TaskFinished) else e for e in events(cloned, steps=2)]
    few, many = io.StringIO(), io.StringIO()
    feed(LineReporter(few, unit="composed", tasks=cloned[:2], clock=Clock()), stream[:8])
    assert few.getvalue().splitlines() == [
        "rank 0: 0% 0 Bytes/8.5 KiB composed",
        "rank 1: 0% 0 Bytes/8.5 KiB composed",
        "rank 0: 50% 4.2 KiB/8.5 KiB composed",
        "rank 1: 50% 4.2 KiB/8.5 KiB composed",
        "rank 0: done, 8.5 KiB: 1.0 KiB written, 7.5 KiB sharing its sources' blocks (reflink)",
        "rank 1: done, 8.5 KiB: 1.0 KiB written, 7.5 KiB sharing its sources' blocks (reflink)",
    ]
    feed(LineReporter(many, unit="composed", tasks=cloned, clock=Clock(0.01)), stream)
    last = many.getvalue().splitlines()[-1]
    assert re.fullmatch(r"total: done, 76\.5 KiB: 9\.0 KiB written, 67\.5 KiB sharing its sources' blocks \(reflink\) "
                        r"by 9 tasks in \d+\.\ds, [\d.]+ \w+/s", last), last


def test_few_tasks_draw_a_bar_each_and_the_total():
    out = io.StringIO()
    bars = BarReporter(out, tasks=tasks(FEW), clock=Clock(), terminal=lambda: terminal_size((200, 5)))
    feed(bars, events(tasks(FEW)))
    bars.close()
    frames = parse(out.getvalue())
    assert all(len(lines) == FEW + 1 for _up, lines in frames)  # every task's bar, as before: whatever the height
    assert frames[-1][1][0].startswith("rank 0 ██████████████████████████████ 100%  8.5 KiB/8.5 KiB")
    assert frames[-1][1][-1].startswith(f"total  {'█' * 30} 100%  68.0 KiB/68.0 KiB written")


def test_few_bars_at_80_columns_never_wrap_and_keep_the_total_whole():
    """At 80 columns the bars narrow so that no line wraps (a wrapped line would make the next redraw
    go up one row too few and leave a stale line): every rank's label, the total with its speed and ETA."""
    out = io.StringIO()
    bars = BarReporter(out, tasks=tasks(FEW), clock=Clock(0.5), terminal=lambda: terminal_size((80, 24)))
    feed(bars, events(tasks(FEW)))
    bars.close()
    frames = parse(out.getvalue())
    drawn = 0
    for up, lines in frames:
        assert up == drawn and all(len(line) < 80 for line in lines)
        drawn = len(lines)
    last = frames[-1][1]
    assert [line.split(" █")[0] for line in last[:-1]] == [f"rank {i}" for i in range(FEW)]
    assert re.fullmatch(r"total  █+ 100%  68.0 KiB/68.0 KiB written  [\d.]+ \w+/s  ETA \d+s", last[-1])


# --- many tasks: logs ------------------------------------------------------------------------------


def test_512_tasks_log_a_few_lines_for_them_all():
    out = io.StringIO()
    planned = tasks(512)
    feed(LineReporter(out, tasks=planned, clock=Clock(0.01)), events(planned))
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 25, lines  # a line every 10% (or 5 s) and the last: not 1,024
    assert not [line for line in lines if line.startswith("rank ")]
    assert lines[0] == "total: 0% 0 Bytes/4.2 MiB written, 0 of 512 tasks done, 1 in progress, 0 Bytes/s"
    assert re.fullmatch(r"total: done, 4\.2 MiB written by 512 tasks in \d+\.\ds, [\d.]+ \w+/s", lines[-1]), lines[-1]
    assert sum(line.startswith("total: done") for line in lines) == 1
    percents = [int(m[1]) for line in lines if (m := re.match(r"total: (\d+)%", line))]
    assert percents == sorted(percents) and all(b - a >= 10 for a, b in zip(percents, percents[1:]))


def test_logs_are_told_the_tasks_up_front():
    report = reporter_for(io.StringIO(), "lines", tasks(512), unit="compared")
    assert isinstance(report, LineReporter) and len(report.tally.totals) == 512 and report.unit == "compared"


def test_the_line_for_all_says_bytes_tasks_and_throughput():
    clock = Clock()
    out = io.StringIO()
    planned = tasks(512)
    lines = LineReporter(out, tasks=planned, clock=clock, every_fraction=2.0)  # by time alone
    stream = events(planned, parallel=3)
    for event in stream:  # up to 37 done and 3 under way
        lines(event)
        if isinstance(event, TaskFinished) and event.task == "rank 36":
            break
    for event in (TaskProgressed("rank 37", 0, RANK), TaskProgressed("rank 38", 100, RANK)):
        lines(event)
    out.truncate(0), out.seek(0)
    clock.now += 10  # a summary is due
    lines(TaskProgressed("rank 38", 200, RANK))
    done = 37 * RANK + 200
    rate, eta = throughput(done, 512 * RANK, 10)
    assert out.getvalue() == (f"total: 7% {size(done)}/4.2 MiB written, 37 of 512 tasks done, 2 in progress, "
                              f"{size(int(rate))}/s, ETA {eta:.0f}s\n")


def test_a_process_own_tasks_unknown_up_front_are_summed_up_once_many():
    """A process of a job sees its own tasks as they start: after FEW, one line for them all."""
    out = io.StringIO()
    report = LineReporter(out, clock=Clock(0.01))  # as `reporter_for(out, "lines")`, with no tasks
    feed(report, events(tasks(64)))
    report.close()
    report.close()  # once
    lines = out.getvalue().splitlines()
    each = [line for line in lines if line.startswith("rank ")]
    assert {int(line.split()[1].rstrip(":")) for line in each} == set(range(FEW))  # the first FEW, then:
    summary = lines[len(each):]
    assert len(summary) <= 12 and all(line.startswith("total: ") for line in summary), lines
    assert re.fullmatch(r"total: 68\.0 KiB written, 8 tasks done, 1 in progress, [\d.]+ KiB/s", summary[0]), summary[0]
    assert summary[-1].startswith("total: done, 544.0 KiB written by 64 tasks in ")


def test_the_job_log_of_many_tasks_is_the_same_summary_labelled_job():
    out = io.StringIO()
    planned = [*tasks(511), ("model file", 77 << 10)]
    job = JobLines(out, planned, clock=Clock(0.01))
    feed(job, events(planned, parallel=16))
    job.close()
    lines = out.getvalue().splitlines()
    assert len(lines) <= 25 and all(line.startswith("job: ") for line in lines), lines
    assert lines[-1].startswith(f"job: done, {size(511 * RANK + (77 << 10))} written by 512 tasks in ")


def test_the_job_log_of_few_tasks_keeps_each_task_lines_and_adds_the_job_line():
    out = io.StringIO()
    job = JobLines(out, tasks(2), every_seconds=5.0, clock=Clock(1.0))
    feed(job, events(tasks(2), steps=2))
    lines = out.getvalue().splitlines()
    assert "rank 0: done, 8.5 KiB written" in lines and "rank 1: done, 8.5 KiB written" in lines
    assert lines[0] == "rank 0: 0% 0 Bytes/8.5 KiB written"
    assert lines[1] == "job: 0% 0 Bytes/17.0 KiB written, 0 of 2 tasks done, 1 in progress, 0 Bytes/s"
    assert not [line for line in lines if line.startswith("job: done")]  # each task said it


# --- many tasks: a terminal ------------------------------------------------------------------------

FRAME = re.compile(r"(?:\x1b\[(\d+)F)?((?:\x1b\[2K[^\n\x1b]*\n)+)(?:\x1b\[J)?")


def parse(text: str) -> list[tuple[int, list[str]]]:
    """The redraws of a BarReporter: (lines the cursor went up, lines drawn), covering all of `text`."""
    frames, at = [], 0
    for m in FRAME.finditer(text):
        assert m.start() == at, repr(text[at:m.start() + 40])  # nothing outside a redraw
        frames.append((int(m[1] or 0), [line.removeprefix("\x1b[2K") for line in m[2].splitlines()]))
        at = m.end()
    assert at == len(text)
    return frames


def test_512_bars_fit_the_terminal_and_go_back_up_exactly():
    sizes = iter([(80, 24)] * 100 + [(60, 12)] * 100 + [(100, 6)] * 1000)  # the window shrinks twice
    asked: list[terminal_size] = []

    def terminal() -> terminal_size:
        asked.append(terminal_size(next(sizes)))
        return asked[-1]

    out = io.StringIO()
    planned = tasks(512)
    bars = BarReporter(out, tasks=planned, clock=Clock(0.03), terminal=terminal)
    feed(bars, events(planned, parallel=30))
    bars.close()
    frames = parse(out.getvalue())
    assert len(frames) == len(asked) > 200  # a redraw asks the terminal's size once
    drawn = 0
    for (up, lines), (columns, rows) in zip(frames, asked):
        assert up == drawn  # back to the top of what was drawn last time, no further
        assert len(lines) <= rows - 2 and all(len(line) < columns for line in lines)  # a row to spare, none wraps
        drawn = len(lines)
    full = [lines for lines in (lines for _up, lines in frames[:100]) if len(lines) == 22]
    assert len(full) > 50 and all(line.startswith("rank ") for line in full[0][:20])  # 20 of the 30 under way
    speed = r"  [\d.]+ \w+/s  ETA \d+s"
    assert all(re.fullmatch(r"… \d+ done, (\d+ more in progress, )?\d+ waiting" + speed, lines[20]) for lines in full)
    assert any(re.fullmatch(r"… \d+ done, 10 more in progress, \d+ waiting" + speed, lines[20]) for lines in full)
    final = frames[-1][1]
    assert re.fullmatch(r"… 512 done, 0 waiting" + speed, final[0]) and len(final) == 2
    assert final[-1] == f"total    {'█' * 30} 100%  4.2 MiB/4.2 MiB written"


def test_bars_on_a_tiny_terminal_show_the_total_alone():
    out = io.StringIO()
    bars = BarReporter(out, tasks=tasks(100), clock=Clock(1.0), terminal=lambda: terminal_size((40, 3)))
    feed(bars, events(tasks(100)))
    frames = parse(out.getvalue())
    assert all(len(lines) == 1 and lines[0].startswith("total") and len(lines[0]) < 40 for _up, lines in frames)


# --- the tally ---------------------------------------------------------------------------------------


def test_the_tally_counts_waiting_in_progress_and_done_tasks():
    tally = Tally(tasks(512))
    for event in (TaskProgressed("rank 0", RANK, RANK), TaskFinished("rank 0", RANK),
                  TaskProgressed("rank 1", 10, RANK), TaskProgressed("rank 2", 0, RANK), TaskFinished("rank 3", RANK)):
        tally.add(event)
    assert (tally.finished, len(tally.running), tally.waiting) == (2, 2, 508)
    assert tally.bytes_done == 2 * RANK + 10 and tally.bytes_total == 512 * RANK
    assert list(tally.running) == ["rank 1", "rank 2"] and not tally.all_done
    assert tally.add("not a task's") is None
    tally.finish_all()
    assert tally.all_done and tally.bytes_done == tally.bytes_total and tally.waiting == 0
