"""Render a terminal capture with ANSI colours (`tmux capture-pane -e -p`) as a PNG, for the README's screenshots:
  tmux capture-pane -e -p -t SESSION > chat.ansi && python scripts/ansi_to_png.py chat.ansi docs/screenshots/chat.png
Handles what our commands print: reset, bold, dim, the 8 foreground colours and the default colour."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"
BOLD_FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono-Bold.ttf"
FONT_SIZE, PADDING = 15, 14
BACKGROUND, FOREGROUND = (30, 30, 36), (220, 220, 220)
COLOURS = [(40, 40, 40), (224, 108, 117), (152, 195, 121), (229, 192, 123), (97, 175, 239), (198, 120, 221),
           (86, 182, 194), (220, 220, 220)]
SGR = re.compile(r"\x1b\[([0-9;]*)m")


@dataclass(frozen=True)
class Style:
    colour: tuple[int, int, int] = FOREGROUND
    bold: bool = False
    dim: bool = False


def styled_runs(line: str, style: Style) -> tuple[list[tuple[str, Style]], Style]:
    runs, at = [], 0
    for code in SGR.finditer(line):
        if code.start() > at:
            runs.append((line[at:code.start()], style))
        for number in [int(n) for n in code[1].split(";") if n] or [0]:
            style = _apply(style, number)
        at = code.end()
    runs.append((line[at:], style))
    return runs, style


def _apply(style: Style, number: int) -> Style:
    if number == 0:
        return Style()
    if number == 1:
        return replace(style, bold=True)
    if number == 2:
        return replace(style, dim=True)
    if number == 22:
        return replace(style, bold=False, dim=False)
    if 30 <= number <= 37:
        return replace(style, colour=COLOURS[number - 30])
    if number == 39:
        return replace(style, colour=FOREGROUND)
    return style


def render(text: str) -> Image.Image:
    lines = text.rstrip("\n").split("\n")
    while lines and not SGR.sub("", lines[-1]).strip():
        lines.pop()
    font, bold_font = ImageFont.truetype(FONT, FONT_SIZE), ImageFont.truetype(BOLD_FONT, FONT_SIZE)
    cell_w, cell_h = font.getlength("M"), int(FONT_SIZE * 1.35)
    columns = max(len(SGR.sub("", line)) for line in lines)
    image = Image.new("RGB", (int(columns * cell_w) + 2 * PADDING, len(lines) * cell_h + 2 * PADDING), BACKGROUND)
    draw, style = ImageDraw.Draw(image), Style()
    for row, line in enumerate(lines):
        runs, style = styled_runs(line, style)
        x = PADDING
        for text_run, run_style in runs:
            colour = run_style.colour
            if run_style.dim:  # halfway to the background
                colour = tuple(c // 2 + b // 2 for c, b in zip(colour, BACKGROUND))
            draw.text((x, PADDING + row * cell_h), text_run, font=bold_font if run_style.bold else font, fill=colour)
            x += len(text_run) * cell_w
    return image


if __name__ == "__main__":
    render(Path(sys.argv[1]).read_text()).save(sys.argv[2])
