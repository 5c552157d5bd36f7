import sys

from jaxembed.testing import main

sys.exit(main())
