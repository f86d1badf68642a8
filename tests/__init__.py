import pytest

# The helpers in tests/support check with `assert` as the tests do: rewritten, a failing check shows its values.
pytest.register_assert_rewrite("tests.support")
