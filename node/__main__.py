import sys

from geofed.node import main

sys.exit(main())
