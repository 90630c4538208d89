from fsdpcheck.cli import main

main()
