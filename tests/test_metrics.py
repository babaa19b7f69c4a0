"""Quality measures against values computed by hand."""

import math

import pytest
import torch

from cachecraft.metrics import best_f1, exact_match, first_line, kl_divergence, normalize_answer, token_f1


def test_token_f1_by_hand():
    # prediction tokens: [paris, france], reference: [paris] -> P=1/2, R=1 -> F1=2/3
    assert token_f1("Paris, France", "paris") == pytest.approx(2 / 3)
    assert token_f1("The Eiffel Tower", "eiffel tower") == 1.0
    assert token_f1("berlin", "paris") == 0.0


def test_best_f1_uses_first_line_and_max_over_answers():
    assert best_f1("London\nParis", ["paris", "london"]) == 1.0
    assert best_f1("in London town", ["paris", "london"]) == pytest.approx(2 * (1 / 3) / (1 / 3 + 1))
    assert best_f1("x", []) == 0.0


def test_exact_match_and_normalisation():
    assert normalize_answer("The  Answer!") == "answer"
    assert exact_match("An apple.\nmore", "apple")
    assert not exact_match("apples", "apple")
    assert first_line("\n\n  hi \nthere") == "hi"


def test_kl_by_hand():
    p = torch.tensor([math.log(0.5), math.log(0.5)])
    q = torch.tensor([math.log(0.25), math.log(0.75)])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_divergence(p, q) == pytest.approx(expected, rel=1e-5)
    assert kl_divergence(p, p) == 0.0


def test_degenerate_repetition_by_hand():
    from cachecraft.metrics import degenerate_repetition

    assert degenerate_repetition("[verse]\n[verse]\n[verse]\n")  # a line three times
    assert degenerate_repetition("The answer is:\n\nThe answer is:\n\nThe answer is:\n\nThe answer")
    assert degenerate_repetition("+ + + + +")  # one word four times in a row
    assert degenerate_repetition("use git bisect git bisect git bisect to find it")  # a phrase three times
    assert not degenerate_repetition("use git bisect, then git bisect good or git bisect bad")  # not back to back
    assert not degenerate_repetition("a a a b")  # three is not yet a degenerate run of one word
    assert not degenerate_repetition("The command `git bisect` is used to find which commit introduced a bug.")
    assert not degenerate_repetition("")
    # words joined by other characters than whitespace: one 'word' to str.split
    assert degenerate_repetition("You can apply a patch from an email using git-git-git-git-git-git-git-git")
    assert degenerate_repetition("[git-gc-gc-gc-gc-gc-")  # 'gc' four times in a row
    assert degenerate_repetition("| version | 2.2.0.1.1.1.1.1.1.")
    assert degenerate_repetition("by the way:of:the:way:of:the:way:of:the")  # 'way of the' three times
    assert not degenerate_repetition("git-rebase-rebase, then git-rebase")  # 'rebase' twice is not yet a run
    assert not degenerate_repetition("Connect to 127.0.0.1 on port 8080 (a-b-c-d).")
    assert not degenerate_repetition("The Kestrel K7: K7: K7-CS-CS-K7-CS")  # 'K7' three times, then 'CS' twice
    # ten runs of letters and digits in a row of at most two different ones, none back to back
    assert degenerate_repetition("The Kestrel K7: K7: K7-CS-CS-K7-CS-CS-K7-CS-K7-")  # K7 K7 K7 CS CS K7 CS CS K7 CS
    assert not degenerate_repetition("The Kestrel K7: K7: K7-CS-CS-K7-CS-CS-K7")  # 'Kestrel' in every ten
    assert not degenerate_repetition("| a | b |\n| --- | --- | --- | --- | --- | --- |\n| 1 | 2 |")  # a table
    # a number four or five times in a row is an address or a version; six times, a loop
    assert not degenerate_repetition("Set 0.0.0.0/0 or 10.0.0.1 to allow every address")  # 0 0 0 0 0 10 0 0 1 to
    assert not degenerate_repetition("Bind to 0.0.0.0, not 127.0.0.1, and allow 0.0.0.0/0 and 0.0.0.0/0")
    assert degenerate_repetition("version 1.1.1.1.1.1")
    assert not degenerate_repetition("version 1.1.1.1.1")
    # Markdown table rows repeat their separators and may leave cells empty
    assert not degenerate_repetition("| a | b | c |\n| --- | --- | --- |\n| 1 | 2 | 3 |")
    assert not degenerate_repetition("| x |  |  |  |  | y |")
    assert not degenerate_repetition("| Yes | Yes | Yes |")
    assert degenerate_repetition("| a | a | a | a |")  # but not their letters and digits
    assert degenerate_repetition("| a |\n| a |\n| a |")  # nor their lines
    assert degenerate_repetition("| a |\n+ + + +")  # and the lines after a table are prose
    # code repeats by design: in a fenced block only a line six times in a row, or a block
    # of lines three times in a row, is a loop
    assert not degenerate_repetition("```c\nint f() {\n  if (x) {\n    while (y) {\n      g();\n    }\n  }\n}\n```")
    assert not degenerate_repetition("```ruby\nclass A\n  def f\n    y\n  end\nend\n```")  # 'end' three times
    assert not degenerate_repetition("```html\n<div><div><div><div>x</div></div></div></div>\n```")
    assert not degenerate_repetition("```python\nm = [[0, 0, 0, 0], [0, 0, 0, 0]]\n```")
    assert not degenerate_repetition("a:\n```\nx\n```\nb:\n```\ny\n```\nc:\n~~~\nz\n~~~")  # three blocks
    assert not degenerate_repetition("```\n" + "x = 1\n" * 5)
    assert degenerate_repetition("```\n" + "x = 1\n" * 6)
    assert degenerate_repetition("```\n" + "a()\nb()\n" * 3)
    assert degenerate_repetition("```\nx\n```\n+ + + +")  # after the block, prose again
    # a code block between two copies of a line: not said again in a row
    assert not degenerate_repetition("Run this command now:\n```\nmake\n```\nRun this command now:")
    # a line of four words or more said again right after itself, blank lines between aside
    assert degenerate_repetition("How to clone?\n\nQuestion: How do I clone?\n\nQuestion: How do I clone?\n\nQ")
    assert degenerate_repetition("- a b c d\n- a b c d")
    assert not degenerate_repetition("- a b\n- a b")  # three words: a short list line may repeat
    assert not degenerate_repetition("one two three four\nsomething else\none two three four")  # not in a row
    # a line of six letter-and-digit words or more said a second time, anywhere
    assert degenerate_repetition("How to clone?\n\nQuestion: How do I clone a repository?\n\nAnswer:\n\n"
                                 "Question: How do I clone a repository?")  # 7 of them
    assert not degenerate_repetition("Question: How do I clone?\nAnswer:\nQuestion: How do I clone?")  # five
    assert not degenerate_repetition("| a | b | c |\n| --- | --- | --- |\n\n| d | e | f |\n| --- | --- | --- |")
    # three lines in a row that differ only in their numbers: one line counting up
    assert degenerate_repetition("* [rc] Merge refs/heads/master from .\n* [rc~1] Merge refs/heads/master from .\n"
                                 "* [rc~2] Merge refs/heads/master from .\n* [rc~3] Merge refs/heads/master from .")
    assert degenerate_repetition("* 1.  Re-check the branch.\n* 2.  Re-check the branch.\n* 13.  Re-check the branch.")
    assert not degenerate_repetition("* 1.  Re-check the branch.\n* 2.  Re-check the branch.")  # two
    assert not degenerate_repetition("1. a b c\n2. a b c\n3. a b c")  # three letter words: a short list line
    assert not degenerate_repetition("- git 2.39.1 (2023-01-17)\n- git 2.39.2 (2023-02-14)\n- git 2.40.0 (2023-03-13)")
    assert not degenerate_repetition("1. Open the menu.\n2. Choose the reset item.\n3. Hold the power button.")
    assert not degenerate_repetition("| 8080 | open on the host |\n| 8081 | open on the host |\n| 8082 | open on the host |")
    assert not degenerate_repetition("step 1 of the plan\n```\nx\n```\nstep 2 of the plan\nstep 3 of the plan")
    # a table row of sixteen equal cells in a row: a separator or empty row that does not end
    assert degenerate_repetition("| Option | Meaning |\n|" + "---|" * 16)
    assert degenerate_repetition("|" + "   |" * 16 + "\n")
    assert not degenerate_repetition("| Option | Meaning |\n|" + "---|" * 15)  # fifteen columns
    assert not degenerate_repetition("|" + "---|" * 8 + "\n|" + "---|" * 8)  # eight and eight: two rows
    assert degenerate_repetition("|" + "---|" * 15 + " --- ")  # a row's last cell needs no closing bar


def test_repetition_watch_by_hand():
    from cachecraft.metrics import RepetitionWatch

    def watch(*texts):
        w = RepetitionWatch()
        return [w(t) for t in texts]

    assert watch("+ + + +", "+ + + + ") == [False, True]  # the fourth '+' counts once a space ends it
    assert watch("[verse]\n[verse]\n[verse]", "[verse]\n[verse]\n[verse]\n") == [False, True]
    assert watch("a b a b a b c") == [True]  # 'a b' three times, ending at the last finished word
    assert watch("git bisect, then", "git bisect, then git bisect good") == [False, False]
    assert watch("a\nb\n\n\n\nc\n") == [False]  # empty lines are not a repeated line
    # a four-word line twice in a row fires once the second copy's line ends
    assert watch("w x y z\n\nw x y z", "w x y z\n\nw x y z\n") == [False, True]
    assert watch("w x y z\nw x y\n", "w x y z\nw x y\nw x y\n") == [False, False]  # three words
    # runs of letters and digits: the last one counts once something else ends it
    assert watch("using git-git-git-git", "using git-git-git-git-") == [False, True]
    assert watch("using git-git-git-gi", "using git-git-git-gitk") == [False, False]
    # ten subwords of two different ones: fires once the tenth is finished
    assert watch("K7: K7: K7-CS-CS-K7-CS-CS-K7-C", "K7: K7: K7-CS-CS-K7-CS-CS-K7-CS-") == [False, True]
    # a table row's words are not checked; the line being written after one is prose
    assert watch("x\n| --- | --- | --- | ---", "x\n| --- | --- | --- | --- |\n") == [False, False]
    assert watch("| a |\n+ + + +", "| a |\n+ + + + ") == [False, True]
    # a long line said again counts once the second copy's line ends
    block = "git-pull(1) and git-fetch(1) from origin.\ngit-push(1) to your repository.\n\n"
    assert watch(block + "git-pull(1) and git-fetch(1) from origin.", block * 2) == [False, True]
    # code lines count once their line ends
    six = "```\n" + "x = 1\n" * 5
    assert watch(six + "x = 1", six + "x = 1\n") == [False, True]
    assert watch("```\n}\n}\n}\n}\n", "```\n}\n}\n}\n}\n```\n+ + + + ") == [False, True]
    # lines that differ only in their numbers: the third counts once its line ends
    counting = "* 1. Re-check the branch.\n* 2. Re-check the branch.\n"
    assert watch(counting + "* 3. Re-check the branch.", counting + "* 3. Re-check the branch.\n") == [False, True]
    # a text that does not extend the last (a decoder that rewrote it) is read again from the start
    line = "one two three four five six\n"
    assert watch(line, line.upper() + line) == [False, False]  # not the same line twice
    assert watch(line, line + line) == [False, True]


def test_repetition_watch_reads_each_line_once(monkeypatch):
    """Fed a long answer token by token, the watch reads each completed line once and
    otherwise only the line being written, not the whole text again on every call."""
    from cachecraft import metrics

    read = []
    real = metrics._add_lines
    monkeypatch.setattr(metrics, "_add_lines", lambda parts, text, *rest, **named: read.append(text) or real(parts, text, *rest, **named))
    topics = ["branches", "tags", "remotes", "hooks", "merges", "rebases", "stashes"]
    lines = [f"{topics[i % 7]} and {topics[i // 7 % 7]} say something new, take {i}.\n" for i in range(49)]
    answer = "".join(lines)
    watch = metrics.RepetitionWatch()
    for end in range(4, len(answer) + 1, 4):
        assert not watch(answer[:end])
    assert max(len(text) for text in read) <= 2 * max(len(line) for line in lines)
    # the line being written is read on each call (about a dozen characters a call here),
    # where reading the whole text each time would read the answer some 1,000 times
    assert sum(len(text) for text in read) < 30 * len(answer)


# Random pieces from small vocabularies, so runs are common: words, table rows, numbers
# and code fences; then whole lines that differ only in their numbers, among others.
WORD_PIECES = ["a", " a", " b", "b", " ", "\n", "a\n", " c d", "\n\n", " a b", "-", "-a", "b-", "\n|", ".1", "\n```"]
LINE_PIECES = ["* 1 a b c d\n", "* 2 a b c d\n", "* 7 a b c d\n", "* 10 a b c d", "\n", "* 3", "4 a b c d\n", " e\n",
               "| 5 a b c d |\n", "```\n", "a b\n"]


TABLE_PIECES = ["---|", "---|", "---|", "|", "\n|", " a |", "--", "-|", "\n"]


@pytest.mark.parametrize("pieces, most", [(WORD_PIECES, 25), (LINE_PIECES, 12), (TABLE_PIECES, 60)],
                         ids=["words", "lines", "tables"])
def test_repetition_watch_agrees_with_the_whole_text_check(pieces, most):
    """Fed a text piece by piece (as tokens come): whenever the watch says yes, the
    whole-text check says yes for that text (what the pipeline checks once generation
    stops), and once the text has moved past a loop (one more line break) the watch has
    said yes."""
    import random

    from cachecraft.metrics import RepetitionWatch, degenerate_repetition

    rng = random.Random(7)
    fired_texts = 0
    for _ in range(1000):
        text, watch, fired = "", RepetitionWatch(), False
        for _ in range(rng.randint(1, most)):
            text += rng.choice(pieces)
            if watch(text):
                assert degenerate_repetition(text), repr(text)
                fired = True
                break
        if not fired:
            fired = watch(text + "\n")
        assert fired == degenerate_repetition(text + "\n"), repr(text)
        fired_texts += fired
    assert 40 < fired_texts < 900  # both outcomes were exercised
