"""Helpers shared by test modules: a test module imports them from here (or takes a fixture from
tests/conftest.py), never from another test module."""
