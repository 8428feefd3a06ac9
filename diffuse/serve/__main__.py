import sys

from diffuse.cli import quiet_libraries
from diffuse.serve import main

quiet_libraries()
sys.exit(main())
