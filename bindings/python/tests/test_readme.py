"""bindings/python/README.md's example is examples/quickstart.py, word for word: the wheel's test (check_wheel.sh) runs
that file, so the README shows a program that runs."""
import os
import re
import unittest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Readme(unittest.TestCase):
    def test_the_example_is_examples_quickstart(self):
        with open(os.path.join(HERE, "README.md")) as f:
            blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
        with open(os.path.join(HERE, "examples", "quickstart.py")) as f:
            self.assertEqual(blocks, [f.read()])


if __name__ == "__main__":
    unittest.main()
