"""CI runs both of the README's commands, verbatim: the main job (in a fresh venv with no extras) and the tests."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ci_runs_both_readme_commands():
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, "the README starts with exactly two commands: the main job and the tests"
    ci_lines = [line.strip() for line in open(os.path.join(ROOT, ".ci", "run")).read().splitlines()]
    main_job, tests = commands
    assert main_job in ci_lines and tests in ci_lines
    # the main job runs in a venv of its own, with nothing installed beyond what it installs itself
    venv_block = "\n".join(ci_lines[ci_lines.index("python -m venv \"$base_venv\""):ci_lines.index(main_job) + 1])
    assert 'source "$base_venv/bin/activate"' in venv_block
