"""Shared fakes and helpers for the tests: nothing here is a test, and no test module imports another."""
