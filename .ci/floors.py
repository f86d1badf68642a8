"""Print pip constraints pinning every direct dependency of pyproject.toml (extras included) at its floor.

CI's "oldest" leg installs with these, so the floors pyproject states are the versions that leg tests.
"""

import re
import sys
import tomllib
from pathlib import Path

REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$")


def floors(pyproject: Path) -> dict[str, str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for group in project.get("optional-dependencies", {}).values():
        requirements += group
    pins: dict[str, str] = {}
    for requirement in requirements:
        name, specifiers = REQUIREMENT.match(requirement).groups()
        floor = [s.strip()[2:].strip() for s in specifiers.split(",") if s.strip().startswith(">=")]
        if len(floor) != 1:
            sys.exit(f"pyproject.toml: give {requirement!r} one floor (>=X) so the oldest CI leg can pin it")
        key = re.sub(r"[-_.]+", "-", name).lower()
        if pins.setdefault(key, floor[0]) != floor[0]:
            sys.exit(f"pyproject.toml: {name} has two floors ({pins[key]} and {floor[0]}): state one")
    return pins


if __name__ == "__main__":
    for name, floor in floors(Path(__file__).resolve().parent.parent / "pyproject.toml").items():
        print(f"{name}=={floor}")
