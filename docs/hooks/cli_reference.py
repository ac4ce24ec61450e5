"""mkdocs hook: fill ``cli.md``'s marker with the reference generated from the CLI's parser."""

from deltastore.cli.reference import markdown

MARKER = "<!-- deltastore:cli-reference -->"


def on_page_markdown(text, page, config, files):  # noqa: ANN001, ANN201 - mkdocs' hook signature
    if MARKER in text:
        return text.replace(MARKER, markdown())
    return text
