"""The README's commands stay the ones CI runs."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    command = ci[ci.index("# --- the README's test command, verbatim ---") + 1]
    assert command in (ROOT / "README.md").read_text()


def test_readme_main_job_uses_specd_up_and_generate():
    readme = (ROOT / "README.md").read_text()
    assert "specd up" in readme and "specd generate" in readme
