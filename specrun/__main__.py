from specrun.cli.app import main

main()
