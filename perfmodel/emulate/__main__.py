import sys
from perfmodel.emulate.cli import main
sys.exit(main())
