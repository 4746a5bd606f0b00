import sys

from ft_plugins.cli import main

sys.exit(main())
