from testbed.app.cli import main

main()
