from shardcheck.cli import main

main()
