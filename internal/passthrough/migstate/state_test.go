package migstate

import (
	"strings"
	"testing"
)

func TestCheckPath(t *testing.T) {
	long := strings.Repeat("a/", MaxPath/2+1) + "a"
	tests := []struct {
		path string
		ok   bool
	}{
		{"a", true},
		{"a/b/c", true},
		{"..a/b..", true},
		{strings.Repeat("x", 255), true},
		{long[:MaxPath], true},
		{long, false},
		{"", false},
		{"/a", false},
		{"a/", false},
		{"a//b", false},
		{".", false},
		{"a/./b", false},
		{"..", false},
		{"a/../../b", false},
		{"a\x00b", false},
		{strings.Repeat("x", 256), false},
	}
	for _, tc := range tests {
		if err := CheckPath(tc.path); (err == nil) != tc.ok {
			t.Errorf("CheckPath(%.40q) = %v", tc.path, err)
		}
	}
}
