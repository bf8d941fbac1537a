"""The grid's lines of a multimodal model: a header per stack, stacks folded into their header,
and cursor moves that pass over open headers and land on folded ones."""

from tailor_tui.ui.grid_lines import GridLines, RowGroup, groups_of


def test_one_stack_has_no_headers():
    lines = GridLines(4, groups_of(["", "", "", ""]))
    assert lines.entries == [0, 1, 2, 3] and lines.lines == [0, 1, 2, 3]
    assert lines.step(0, 2) == 2 and lines.step(3, 5) == 3 and lines.step(1, -5) == 0


def test_stacks_have_headers_and_fold():
    groups = groups_of(["vision"] * 3 + ["language"] * 2)
    assert groups == (RowGroup("vision", 0, 2), RowGroup("language", 3, 4))
    open_ = GridLines(5, groups)
    assert open_.entries == [groups[0], 0, 1, 2, groups[1], 3, 4]
    assert open_.step(2, 1) == 3  # the language header is passed over
    assert open_.step(3, -1) == 2
    assert open_.step(0, -1) == 0  # the first header stands for no row: the cursor stays
    folded = GridLines(5, groups, folded={"vision"})
    assert folded.entries == [groups[0], groups[1], 3, 4]
    assert folded.lines == [0, 0, 0, 2, 3]
    assert folded.folded_at(1) == groups[0] and folded.folded_at(3) is None
    assert folded.step(3, -1) == 0  # onto the folded header: its first row
    assert folded.step(0, 1) == 3
    assert folded.row_at(1) is None and folded.row_at(0) == 0
    assert GridLines(5, groups, folded={"nothing"}).folded == set()
