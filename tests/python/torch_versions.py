"""Run a test file of qkv.torch against one named torch: by pytest under
Debian's /usr/bin/python3 (torch 1.13, the default) or as a script in the
venv with `--torch 2.13.0` (tests/CMakeLists.txt's qkv_venv_test), so the
file's TorchVersion test fails when the torch found is not the one named.
Shared by test_torch_mha.py and test_torch_expectations.py."""

import sys
import unittest


def main(module):
    """unittest.main over `module`, after taking `--torch VERSION` from the
    command line into module.EXPECTED_TORCH; prints the replay line first."""
    if "--torch" in sys.argv:
        at = sys.argv.index("--torch")
        module.EXPECTED_TORCH = sys.argv[at + 1]
        del sys.argv[at:at + 2]
    print(f"seed {module.SEED}; replay: QKV_TEST_SEED={module.SEED} {sys.executable} "
          f"{module.__file__} --torch {module.EXPECTED_TORCH}")
    unittest.main(module=module, verbosity=2)
