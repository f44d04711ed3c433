from shardcheck.cli import main

# Guarded: a spawned child process (runtime/supervised.py) imports this module again.
if __name__ == "__main__":
    main()
