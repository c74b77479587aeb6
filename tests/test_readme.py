"""CI runs the README's test command, verbatim."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, "the README starts with exactly two commands: the main job and the tests"
    ci_lines = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    assert commands[1] in ci_lines
