#!/bin/bash
# Verifier: reward 1 when /app/greeting.txt holds exactly "hello from mizzen", else 0.
mkdir -p /logs/verifier
if [ -f /app/greeting.txt ] && [ "$(cat /app/greeting.txt)" = "hello from mizzen" ]; then
  echo 1 > /logs/verifier/reward.txt
  echo "greeting found"
else
  echo 0 > /logs/verifier/reward.txt
  echo "greeting missing or wrong"
fi
