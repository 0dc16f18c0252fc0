"""Run the tests and print one summary line: `N passed, M failed`."""
import sys
import unittest

suite = unittest.defaultTestLoader.discover(".", pattern="test_*.py")
result = unittest.TextTestRunner(stream=sys.stdout, verbosity=2).run(suite)
failed = len(result.failures) + len(result.errors)
passed = result.testsRun - failed
print(f"{passed} passed, {failed} failed")
sys.exit(0 if failed == 0 else 1)
