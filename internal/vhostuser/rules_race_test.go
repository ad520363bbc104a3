//go:build race

package vhostuser

import "testing"

// TestRaceBuildChecksRules: the tests run with -race, so they must check
// the rules (TestRulesChecked skips where they are not).
func TestRaceBuildChecksRules(t *testing.T) {
	if !checkRules {
		t.Fatal("a -race build does not check the scheduler's counting rules")
	}
}
