#!/bin/bash
# Reference solution run by Harbor's oracle agent.
set -eu
mkdir -p /app
printf 'hello from mizzen\n' > /app/greeting.txt
