"""lmtrace's tests: tests/<package>/ holds the tests of lmtrace/<package>/, tests/helpers/ what they share."""
