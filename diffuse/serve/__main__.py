import sys

from diffuse.cli.command import quiet_libraries
from diffuse.serve import main

quiet_libraries()
sys.exit(main())
