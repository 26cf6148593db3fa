import sys
from pathlib import Path

# The tests import the reference implementation as a plain module beside them.
sys.path.insert(0, str(Path(__file__).parent))
