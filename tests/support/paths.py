"""Where the tests' files are: the test folder, its bundled data, the repository."""

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
DATA_DIR = TESTS_DIR / "data"
REPO_DIR = TESTS_DIR.parent
