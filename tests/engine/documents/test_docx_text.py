"""What a .docx gives the model: the text Word shows, wherever the XML puts it.

Each document is built with python-docx, with the XML Word writes for the case
put in its body. Every marker must come out exactly once, and text Word does
not show (deleted revisions, a field's code) not at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import docx
from docx.opc.constants import CONTENT_TYPE as CT
from docx.opc.constants import RELATIONSHIP_TYPE as RT
from docx.opc.packuri import PackURI
from docx.opc.part import Part
from docx.oxml import parse_xml

from engine.documents.reader import read_document

NAMESPACES = (
    'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main" '
    'xmlns:mc="http://schemas.openxmlformats.org/markup-compatibility/2006" '
    'xmlns:wps="http://schemas.microsoft.com/office/word/2010/wordprocessingShape" '
    'xmlns:v="urn:schemas-microsoft-com:vml"'
)


def _with_body_xml(*blocks: str) -> Any:
    """A Word document whose body holds ``blocks``, each an element of WordprocessingML
    declaring its namespaces, before its section properties."""
    document = docx.Document()
    body = document.element.body
    for block in blocks:
        body.insert(len(body) - 1, parse_xml(block))
    return document


def _text(tmp_path: Path, document: Any) -> str:
    path = tmp_path / "document.docx"
    document.save(str(path))
    return read_document(path).text


def _run(text: str) -> str:
    return f'<w:r><w:t xml:space="preserve">{text}</w:t></w:r>'


def _paragraph(*inner: str) -> str:
    return f"<w:p {NAMESPACES}>{''.join(inner)}</w:p>"


def _assert_once(text: str, *markers: str) -> None:
    for marker in markers:
        assert text.count(marker) == 1, (marker, text)


def test_text_inside_revisions_fields_controls_and_wrappers_is_read_once(tmp_path: Path) -> None:
    document = _with_body_xml(
        _paragraph(_run("Before "), '<w:ins w:id="1" w:author="a">', _run("INSERTED"),
                   "</w:ins>", '<w:del w:id="2" w:author="a"><w:r><w:delText>DELETED'
                   "</w:delText></w:r></w:del>", _run(" after.")),
        _paragraph('<w:moveFrom w:id="3" w:author="a">', _run("MOVED_AWAY"), "</w:moveFrom>",
                   '<w:moveTo w:id="4" w:author="a">', _run("MOVED_HERE"), "</w:moveTo>"),
        _paragraph(_run("Field: "), '<w:fldSimple w:instr="DATE">', _run("SIMPLE_FIELD"),
                   "</w:fldSimple>"),
        _paragraph('<w:r><w:fldChar w:fldCharType="begin"/></w:r>',
                   '<w:r><w:instrText xml:space="preserve"> REF FIELD_CODE </w:instrText></w:r>',
                   '<w:r><w:fldChar w:fldCharType="separate"/></w:r>', _run("COMPLEX_FIELD"),
                   '<w:r><w:fldChar w:fldCharType="end"/></w:r>'),
        _paragraph("<w:sdt><w:sdtPr><w:alias w:val='Name'/></w:sdtPr><w:sdtContent>",
                   _run("INLINE_CONTROL"), "</w:sdtContent></w:sdt>"),
        f"<w:sdt {NAMESPACES}><w:sdtContent>{_paragraph(_run('BLOCK_CONTROL'))}"
        "</w:sdtContent></w:sdt>",
        _paragraph('<w:smartTag w:uri="urn:x" w:element="place">', _run("SMART_TAG"),
                   "</w:smartTag>"),
        _paragraph('<w:customXml w:element="name">', _run("INLINE_CUSTOM_XML"),
                   "</w:customXml>"),
        f'<w:customXml {NAMESPACES} w:element="block">{_paragraph(_run("BLOCK_CUSTOM_XML"))}'
        "</w:customXml>",
        _paragraph('<w:dir w:val="rtl">', _run("DIR_TEXT"), '</w:dir><w:bdo w:val="rtl">',
                   _run("BDO_TEXT"), "</w:bdo>"),
        # A paragraph's tab stops are properties, not tabs in its text.
        _paragraph('<w:pPr><w:tabs><w:tab w:val="left" w:pos="720"/></w:tabs></w:pPr>',
                   _run("Stops")),
    )
    text = _text(tmp_path, document)
    _assert_once(text, "INSERTED", "MOVED_HERE", "SIMPLE_FIELD", "COMPLEX_FIELD",
                 "INLINE_CONTROL", "BLOCK_CONTROL", "SMART_TAG", "INLINE_CUSTOM_XML",
                 "BLOCK_CUSTOM_XML", "DIR_TEXT", "BDO_TEXT")
    for hidden in ("DELETED", "MOVED_AWAY", "FIELD_CODE", "Name"):
        assert hidden not in text
    assert text.splitlines()[0] == "Before INSERTED after."
    assert text.splitlines()[-1] == "Stops"


def test_a_document_written_with_track_changes_on_is_read(tmp_path: Path) -> None:
    document = _with_body_xml(_paragraph('<w:ins w:id="1" w:author="a">',
                                         _run("All of this was typed with Track Changes on."),
                                         "</w:ins>"))
    assert _text(tmp_path, document) == "All of this was typed with Track Changes on."


def test_page_and_column_breaks_keep_the_words_apart(tmp_path: Path) -> None:
    kinds = (("Preface.", "page"), ("Left.", "column"), ("Line.", "textWrapping"))
    breaks = [f'<w:r><w:t>{word}</w:t><w:br w:type="{kind}"/></w:r>' for word, kind in kinds]
    document = _with_body_xml(_paragraph(*breaks, _run("Chapter")))
    assert _text(tmp_path, document) == "Preface.\nLeft.\nLine.\nChapter"


def _text_box(text: str) -> str:
    return f"<w:txbxContent>{_paragraph(_run(text))}</w:txbxContent>"


def test_a_text_box_is_read_once_after_its_paragraph(tmp_path: Path) -> None:
    # Word writes a text box twice: as a drawing, and in VML for older readers.
    twice = ("<w:r><mc:AlternateContent><mc:Choice Requires='wps'><w:drawing><wps:wsp>"
             f"<wps:txbx>{_text_box('TEXT_BOX')}</wps:txbx></wps:wsp></w:drawing></mc:Choice>"
             f"<mc:Fallback><w:pict><v:shape><v:textbox>{_text_box('TEXT_BOX')}</v:textbox>"
             "</v:shape></w:pict></mc:Fallback></mc:AlternateContent></w:r>")
    vml_only = (f"<w:r><w:pict><v:shape><v:textbox>{_text_box('OLD_TEXT_BOX')}</v:textbox>"
                "</v:shape></w:pict></w:r>")
    document = _with_body_xml(_paragraph(_run("Anchor."), twice),
                              _paragraph(vml_only), _paragraph(_run("After.")))
    assert _text(tmp_path, document) == "Anchor.\nTEXT_BOX\n\nOLD_TEXT_BOX\nAfter."


def test_a_document_made_of_text_boxes_is_read(tmp_path: Path) -> None:
    document = _with_body_xml(_paragraph(
        f"<w:r><w:pict><v:shape><v:textbox>{_text_box('Only in a box.')}</v:textbox>"
        "</v:shape></w:pict></w:r>"))
    assert _text(tmp_path, document) == "Only in a box."


def test_merged_cells_once_and_nested_tables_inside_their_cell(tmp_path: Path) -> None:
    document = docx.Document()
    table = document.add_table(rows=3, cols=3)
    for row, names in zip(table.rows, (("A1", "B1", "C1"), ("A2", "B2", "C2"),
                                       ("A3", "B3", "C3")), strict=True):
        for cell, name in zip(row.cells, names, strict=True):
            cell.text = name
    table.cell(0, 0).merge(table.cell(0, 2)).text = "ACROSS"
    table.cell(1, 0).merge(table.cell(2, 0)).text = "DOWN"
    inner = table.cell(1, 1).add_table(rows=1, cols=2)
    inner.cell(0, 0).text, inner.cell(0, 1).text = "NESTED_1", "NESTED_2"
    text = _text(tmp_path, document)
    _assert_once(text, "ACROSS", "DOWN", "NESTED_1", "NESTED_2")
    # A cell spanning rows is read in its first; the rows below keep its column. A
    # nested table stays on its cell's line, its cells parted by bars, not tabs.
    assert text == "ACROSS\nDOWN\tB2 / NESTED_1 | NESTED_2\tC2\n\tB3\tC3"


def test_a_table_row_deleted_with_track_changes_on_is_not_read(tmp_path: Path) -> None:
    row = "<w:tr><w:trPr>{mark}</w:trPr><w:tc><w:p>{run}</w:p></w:tc></w:tr>"
    deleted = row.format(mark='<w:del w:id="1" w:author="a"/>',
                         run='<w:del w:id="2" w:author="a"><w:r><w:delText>GONE</w:delText>'
                             "</w:r></w:del>")
    first, last = (row.format(mark="", run=_run(text)) for text in ("FIRST", "LAST"))
    document = _with_body_xml(f"<w:tbl {NAMESPACES}><w:tblGrid><w:gridCol/></w:tblGrid>"
                              f"{first}{deleted}{last}</w:tbl>")
    assert _text(tmp_path, document) == "FIRST\nLAST"


def test_headers_and_footers_each_once_under_a_label(tmp_path: Path) -> None:
    document = docx.Document()
    document.add_paragraph("Body.")
    first = document.sections[0]
    first.header.paragraphs[0].text = "PAGE_HEADER"
    first.footer.paragraphs[0].text = "PAGE_FOOTER"
    first.different_first_page_header_footer = True
    first.first_page_header.paragraphs[0].text = "TITLE_PAGE_HEADER"
    second = document.add_section()  # shows the first section's header and footer
    second.footer.is_linked_to_previous = False
    second.footer.paragraphs[0].text = "PAGE_FOOTER"  # its own part, the same text
    document.add_paragraph("More body.")
    assert _text(tmp_path, document) == (
        "Body.\n\nMore body.\n\nPage headers:\nPAGE_HEADER\nTITLE_PAGE_HEADER"
        "\n\nPage footers:\nPAGE_FOOTER")


def _notes_part(document: Any, kind: str, notes: list[str]) -> None:
    """Give ``document`` a footnotes (or endnotes) part holding Word's two separators,
    then one note per text in ``notes``."""
    tag = kind[:-1]
    separators = "".join(
        f'<w:{tag} w:type="{kind_}" w:id="{i - 1}"><w:p><w:r><w:{kind_}/></w:r></w:p></w:{tag}>'
        for i, kind_ in enumerate(("separator", "continuationSeparator")))
    bodies = "".join(
        f'<w:{tag} w:id="{i + 1}"><w:p><w:r><w:{tag}Ref/></w:r>{_run(" " + note)}</w:p>'
        f"</w:{tag}>" for i, note in enumerate(notes))
    xml = f"<w:{kind} {NAMESPACES}>{separators}{bodies}</w:{kind}>".encode()
    content_type = CT.WML_FOOTNOTES if kind == "footnotes" else CT.WML_ENDNOTES
    reltype = RT.FOOTNOTES if kind == "footnotes" else RT.ENDNOTES
    part = Part(PackURI(f"/word/{kind}.xml"), content_type, xml, document.part.package)
    document.part.relate_to(part, reltype)


def test_footnotes_and_endnotes_under_their_labels_without_separators(tmp_path: Path) -> None:
    document = _with_body_xml(_paragraph(_run("Claim."),
                                         '<w:r><w:footnoteReference w:id="1"/></w:r>'))
    _notes_part(document, "footnotes", ["FIRST_FOOTNOTE", "SECOND_FOOTNOTE"])
    _notes_part(document, "endnotes", ["AN_ENDNOTE"])
    document.sections[0].header.paragraphs[0].text = "HEADER"
    assert _text(tmp_path, document) == (
        "Claim.\n\nPage headers:\nHEADER\n\nFootnotes:\nFIRST_FOOTNOTE\nSECOND_FOOTNOTE"
        "\n\nEndnotes:\nAN_ENDNOTE")


def test_a_document_read_correctly_before_reads_the_same(tmp_path: Path) -> None:
    document = docx.Document()
    document.add_heading("Plan", level=1)
    paragraph = document.add_paragraph("Tabs\tand ")
    paragraph.add_run("runs").bold = True
    paragraph.add_run(" with a break\nand more.")
    document.add_paragraph("")
    table = document.add_table(rows=2, cols=2)
    table.cell(0, 0).text, table.cell(0, 1).text = "q6", "388 bytes"
    table.cell(1, 0).text = "two\nlines"
    table.cell(1, 1).add_paragraph("second paragraph")
    document.add_page_break()
    document.element.body.insert(len(document.element.body) - 1, parse_xml(_paragraph(
        '<w:hyperlink w:anchor="x">', _run("a link "), "</w:hyperlink>",
        "<w:r><w:t>non</w:t><w:noBreakHyphen/><w:t>breaking</w:t><w:ptab "
        'w:relativeTo="margin" w:alignment="right" w:leader="none"/><w:t>end</w:t></w:r>')))
    # What python-docx's Paragraph.text gave, this reader's old way, but for the
    # page break's paragraph (one more blank line, not none) and a cell's lines and
    # paragraphs, kept on its row's line (a new line would read as a new row).
    assert _text(tmp_path, document) == (
        "Plan\nTabs\tand runs with a break\nand more.\n\nq6\t388 bytes\n"
        "two / lines\tsecond paragraph\n\n\na link non-breaking\tend")


def test_a_cell_of_several_paragraphs_stays_on_its_rows_line(tmp_path: Path) -> None:
    document = docx.Document()
    table = document.add_table(rows=2, cols=3)
    for cell, text in zip(table.rows[0].cells, ("Name", "Address", "Phone"), strict=True):
        cell.text = text
    ann = table.rows[1].cells
    ann[0].text, ann[2].text = "Ann", "555-1"
    ann[1].text = "1 Main St"
    ann[1].add_paragraph("Springfield")
    assert _text(tmp_path, document) == "Name\tAddress\tPhone\nAnn\t1 Main St / Springfield\t555-1"


def test_list_paragraphs_keep_their_numbers_and_bullets(tmp_path: Path) -> None:
    """Numbers Word counts (levels, restarts, letters) and bullets, as Word shows them."""
    document = docx.Document()
    numbering = document.part.numbering_part.element
    numbering.append(parse_xml(
        f'<w:abstractNum {NAMESPACES} w:abstractNumId="90">'
        '<w:lvl w:ilvl="0"><w:start w:val="1"/><w:numFmt w:val="decimal"/>'
        '<w:lvlText w:val="%1."/></w:lvl>'
        '<w:lvl w:ilvl="1"><w:start w:val="1"/><w:numFmt w:val="lowerLetter"/>'
        '<w:lvlText w:val="%1.%2)"/></w:lvl></w:abstractNum>'))
    numbering.append(parse_xml(
        f'<w:abstractNum {NAMESPACES} w:abstractNumId="91">'
        '<w:lvl w:ilvl="0"><w:numFmt w:val="bullet"/><w:lvlText w:val="\uf0b7"/></w:lvl>'
        '</w:abstractNum>'))
    for num_id, abstract in (("90", "90"), ("91", "91")):
        numbering.append(parse_xml(f'<w:num {NAMESPACES} w:numId="{num_id}">'
                                   f'<w:abstractNumId w:val="{abstract}"/></w:num>'))
    numbering.append(parse_xml(
        f'<w:num {NAMESPACES} w:numId="92"><w:abstractNumId w:val="90"/>'
        '<w:lvlOverride w:ilvl="0"><w:startOverride w:val="7"/></w:lvlOverride></w:num>'))

    def item(text: str, num_id: str, level: int = 0) -> str:
        return _paragraph(f'<w:pPr><w:numPr><w:ilvl w:val="{level}"/><w:numId w:val="{num_id}"/>'
                          f"</w:numPr></w:pPr>", _run(text))

    body = document.element.body
    for block in (_paragraph(_run("Terms:")), item("The buyer pays.", "90"),
                  item("On time.", "90", 1), item("In full.", "90", 1),
                  item("The seller delivers.", "90"), item("Whole.", "90", 1),
                  item("Pines", "91"), item("Sand", "91"), item("Seventh.", "92"),
                  _paragraph(_run("See clause 2 above."))):
        body.insert(len(body) - 1, parse_xml(block))
    assert _text(tmp_path, document) == (
        "Terms:\n1. The buyer pays.\n1.a) On time.\n1.b) In full.\n2. The seller delivers.\n"
        "2.a) Whole.\n• Pines\n• Sand\n7. Seventh.\nSee clause 2 above.")


def test_equations_are_read_as_a_line_of_text_and_hidden_text_is_not(tmp_path: Path) -> None:
    math = 'xmlns:m="http://schemas.openxmlformats.org/officeDocument/2006/math"'
    energy = _paragraph(
        _run("Energy: "), f"<m:oMath {math}><m:r><m:t>E=m</m:t></m:r><m:sSup><m:e><m:r>"
        "<m:t>c</m:t></m:r></m:e><m:sup><m:r><m:t>2</m:t></m:r></m:sup></m:sSup></m:oMath>",
        _run(" holds."))
    alone = _paragraph(
        f"<m:oMathPara {math}><m:oMath><m:f><m:num><m:r><m:t>a+b</m:t></m:r></m:num><m:den>"
        "<m:r><m:t>n-1</m:t></m:r></m:den></m:f><m:sSub><m:e><m:r><m:t>x</m:t></m:r></m:e>"
        "<m:sub><m:r><m:t>i</m:t></m:r></m:sub></m:sSub></m:oMath></m:oMathPara>")
    hidden = _paragraph(_run("Visible "), '<w:r><w:rPr><w:vanish/></w:rPr><w:t>HIDDEN</w:t></w:r>',
                        '<w:r><w:rPr><w:vanish w:val="0"/></w:rPr><w:t>shown</w:t></w:r>')
    text = _text(tmp_path, _with_body_xml(energy, alone, hidden))
    assert text == "Energy: E=mc^2 holds.\n(a+b)/(n-1)x_i\nVisible shown"
