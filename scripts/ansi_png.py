"""A terminal's screen as PNG, for the screenshots under docs/screenshots: reads what `tmux capture-pane -p -e`
printed (text with ANSI escapes) and draws it cell by cell in DejaVu Sans Mono on a dark theme.

    tmux capture-pane -p -e -t SESSION > screen.ansi
    python scripts/ansi_png.py screen.ansi docs/screenshots/top.png

Regenerate the committed ones from their captures:
    for n in chat top bench; do python scripts/ansi_png.py docs/screenshots/$n.ansi docs/screenshots/$n.png; done
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont
from rich.color import Color
from rich.console import Console
from rich.terminal_theme import MONOKAI, TerminalTheme
from rich.text import Text

FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")


def render(ansi: str, out: Path, theme: TerminalTheme = MONOKAI, font_size: int = 15, pad: int = 14) -> None:
    # decoded as one text: tmux writes a style only where it changes, so a style may carry over a line break
    texts = Text.from_ansi(ansi).split("\n", allow_blank=True)
    while texts and not texts[-1].plain.strip():
        texts.pop()
    regular = ImageFont.truetype(str(FONT_DIR / "DejaVuSansMono.ttf"), font_size)
    bold = ImageFont.truetype(str(FONT_DIR / "DejaVuSansMono-Bold.ttf"), font_size)
    cell_w, cell_h = regular.getlength("M"), round(font_size * 1.4)
    columns = max(text.cell_len for text in texts)
    background = tuple(theme.background_color)
    image = Image.new("RGB", (round(columns * cell_w) + 2 * pad, len(texts) * cell_h + 2 * pad), background)
    draw = ImageDraw.Draw(image)
    console = Console(width=columns + 1, color_system="truecolor")
    for row, text in enumerate(texts):
        column = 0
        for segment in text.render(console, end=""):
            style = segment.style
            fg = _rgb(style.color if style else None, theme, foreground=True)
            bg = _rgb(style.bgcolor if style else None, theme, foreground=False)
            if style is not None and style.reverse:
                fg, bg = bg, fg
            if style is not None and style.dim:
                fg = tuple((a + b) // 2 for a, b in zip(fg, background))
            x, y = pad + column * cell_w, pad + row * cell_h
            width = len(segment.text)
            if bg != background:
                draw.rectangle([x, y, x + width * cell_w, y + cell_h], fill=bg)
            font = bold if style is not None and style.bold else regular
            for i, char in enumerate(segment.text):  # per cell: glyphs stay on the grid
                draw.text((x + i * cell_w, y + (cell_h - font_size) // 2), char, font=font, fill=fg)
            column += width
    image.save(out)


def _rgb(color: Color | None, theme: TerminalTheme, foreground: bool) -> tuple[int, int, int]:
    if color is None or color.is_default:
        return tuple(theme.foreground_color if foreground else theme.background_color)
    return tuple(color.get_truecolor(theme, foreground=foreground))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ansi", help="a file of captured terminal text with ANSI escapes")
    parser.add_argument("png")
    args = parser.parse_args()
    render(Path(args.ansi).read_text(), Path(args.png))


if __name__ == "__main__":
    main()
