import sys

from diffuse.serve import main

sys.exit(main())
