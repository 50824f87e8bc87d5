"""Small PDFs written by hand (fpdf2 is not installed): one Helvetica text stream per page, or a drawing only."""

from __future__ import annotations

import io

from pypdf import PdfReader, PdfWriter


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def _text_stream(lines: list[str]) -> bytes:
    body = "".join(f"({_escape(line)}) Tj T*\n" for line in lines)
    return f"BT /F1 11 Tf 14 TL 50 780 Td\n{body}ET".encode("latin-1")


DRAWING_ONLY = b"0 0 1 rg 100 100 300 400 re f"  # a filled rectangle: a page with no text at all


def make_pdf(pages: list[list[str]] | None = None, *, streams: list[bytes] | None = None) -> bytes:
    """A PDF with one page per list of text lines (or per raw content stream)."""
    contents = streams if streams is not None else [_text_stream(lines) for lines in pages or []]
    page_count = len(contents)
    # Objects: 1 catalog, 2 pages, 3 font, then per page a page object and its content stream.
    page_ids = [4 + 2 * i for i in range(page_count)]
    objects: list[bytes] = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{' '.join(f'{pid} 0 R' for pid in page_ids)}] /Count {page_count} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for pid, stream in zip(page_ids, contents, strict=True):
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
            f"/Contents {pid + 1} 0 R >>".encode()
        )
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    return build_pdf(objects)


def build_pdf(objects: list[bytes]) -> bytes:
    """A PDF of these objects, numbered from 1 (the first is the catalog), with its cross-reference table."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, obj in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + obj + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def encrypt_pdf(data: bytes, user_password: str = "secret") -> bytes:
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(data)))
    writer.encrypt(user_password=user_password, owner_password="owner", algorithm="RC4-128")
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()
