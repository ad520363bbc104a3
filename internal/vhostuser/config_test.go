package vhostuser

import (
	"encoding/binary"
	"io"
	"log/slog"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// TestConfigRequestQueuesFollowRings: num_request_queues in GET_CONFIG is
// Config.RequestQueues capped by the rings the front end set up with
// SET_VRING_CALL, less hiprio (QEMU's generic vhost-user-test-device-pci
// passes our config to the guest and has num_vqs rings whatever we say);
// before any SET_VRING_CALL it is Config.RequestQueues.
func TestConfigRequestQueuesFollowRings(t *testing.T) {
	for _, c := range []struct{ configured, rings, want int }{
		{255, 2, 1}, {255, 3, 2}, {4, 3, 2}, {4, 5, 4}, {4, 9, 4}, {1, 2, 1}, {2, 0, 2},
	} {
		b, err := NewBackend(Config{RequestQueues: c.configured, Tag: "myfs",
			Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
			Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} })})
		if err != nil {
			t.Fatal(err)
		}
		o := vmm.DefaultOptions()
		o.ProtocolFeatures |= vmm.Bit(vmm.PConfig)
		o.Queues = max(c.rings, 2)
		d := serveOne(t, b, func(sock string) (*vmm.Device, error) {
			d, err := vmm.Connect(sock, o)
			if err != nil || c.rings == 0 {
				return d, err // no SET_VRING_CALL at all
			}
			return d, d.Init()
		})
		cfg, err := d.Conn.GetConfig(0, 40, 0)
		if err != nil {
			t.Fatal(err)
		}
		if got := binary.LittleEndian.Uint32(cfg[36:]); int(got) != c.want || string(cfg[:4]) != "myfs" {
			t.Errorf("--queues %d, %d rings set up: config %q num_request_queues %d, want %d", c.configured, c.rings, cfg[:4], got, c.want)
		}
	}
}
