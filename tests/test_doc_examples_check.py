"""The docs build's example check (scripts/check_doc_examples.py) and the docstring rename
(scripts/docstring_examples.py): the check fails on the HTML that `Example:` sections produced and
passes on the HTML of `Examples:` sections; the rename is idempotent and touches docstrings only."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _script("check_doc_examples")
rename = _script("docstring_examples")

# What mkdocstrings made of an `Example:` section before the rename (copied from the built site):
# the prompts became nested quotes, the lines one paragraph.
QUOTED = """<h2 id="jaxdist.strategies.ProgramMismatchError">ProgramMismatchError</h2>
<details class="example" open><summary>Example</summary>
<blockquote><blockquote><blockquote>
<p>import jaxdist as jd
issubclass(jd.strategies.ProgramMismatchError, RuntimeError)
True</p>
</blockquote></blockquote></blockquote></details>"""
# ... and of a titled one, `Example (what it shows):`: plain text.
PLAIN = """<div class="doc doc-object" id="jaxdist.training.Checkpointer.read">
<p>Example (the state and the input position of one checkpoint, read as one):
    &gt;&gt;&gt; import tempfile, numpy as np, jaxdist as jd
    &gt;&gt;&gt; ckpt.close()</p></div>"""
# An `Examples:` section: a highlighted code block, a prompt per line, output lines between them.
GOOD = """<h3 id="jaxdist.Strategy.scope">scope</h3>
<div class="highlight"><pre><span></span><code><span class="gp">&gt;&gt;&gt; </span><span class="kn">import</span> jd
<span class="gp">&gt;&gt;&gt; </span>jd.get_strategy() <span class="ow">is</span> s
<span class="go">True</span>
</code></pre></div>
<p>Guides may mention the <code>&gt;&gt;&gt;</code> prompt in prose.</p>"""


def test_the_check_passes_code_blocks_with_their_line_breaks():
    assert check.check_html(GOOD) == ([], 2)


def test_the_check_fails_on_prompts_read_as_markdown_quotes():
    problems, prompts = check.check_html(QUOTED)
    assert prompts == 0
    assert problems == ["jaxdist.strategies.ProgramMismatchError: '>>>' rendered as nested quotes"]


def test_the_check_fails_on_prompts_in_plain_text():
    problems, _ = check.check_html(PLAIN)
    assert len(problems) == 1
    assert problems[0].startswith("jaxdist.training.Checkpointer.read: '>>>' outside a code block: "
                                  "'")


def test_the_check_fails_on_a_code_block_whose_lines_ran_together():
    problems, prompts = check.check_html("<pre><code>&gt;&gt;&gt; import jd &gt;&gt;&gt; "
                                         "jd.x\n1</code></pre>")
    assert prompts == 1
    assert problems == ["top of page: '>>>' in a code block without its line break: '>>> import jd "
                        ">>> jd.x'"]


def test_the_check_of_a_site_names_page_and_fix(tmp_path, capsys):
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "index.html").write_text(QUOTED)
    (tmp_path / "index.html").write_text(GOOD)
    assert check.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert (
        "api/index.html: jaxdist.strategies.ProgramMismatchError: '>>>' rendered as nested quotes"
        in err
    )
    assert "name the docstring section 'Examples:' (python scripts/docstring_examples.py" in err
    (tmp_path / "api" / "index.html").write_text(GOOD)
    assert check.main([str(tmp_path)]) == 0
    assert "4 '>>>' prompts, all in code blocks" in capsys.readouterr().out


def test_the_check_of_an_unbuilt_site_says_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError,
                       match=r"site='.*' holds no HTML page: build the site first"):
        check.check_site(tmp_path)


MODULE = '''"""Module.

Example:
    >>> 1
    1
"""

EXAMPLE = """
Example:
    not a docstring, left alone
"""


def f():
    """F.

    Example (a call, as a user writes it):
        >>> f()
    """
'''


def test_the_rename_changes_docstring_sections_only_and_is_idempotent():
    once = rename.convert(MODULE)
    assert once.count("Examples:") == 2
    assert '"""\nExample:\n    not a docstring, left alone' in once  # a string that is no docstring
    assert "    Examples:\n        A call, as a user writes it:\n\n        >>> f()" in once
    assert rename.convert(once) == once


def test_the_rename_leaves_a_header_without_a_body_alone():
    source = 'def f():\n    """F.\n\n    Example:\n    """\n'
    assert rename.convert(source) == source
