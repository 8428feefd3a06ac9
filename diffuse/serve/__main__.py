import sys

from diffuse.cli.command import quiet_libraries
from diffuse.serve.command import main

quiet_libraries()
sys.exit(main())
